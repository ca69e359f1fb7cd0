from fp8rl.rpc import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CalibrateRequest(_message.Message):
    __slots__ = ("version", "sequences", "images")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    version: int
    sequences: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenSequence]
    images: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, version: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[_common_pb2.TokenSequence, _Mapping]]] = ..., images: _Optional[_Iterable[bytes]] = ...) -> None: ...

class CalibrateResponse(_message.Message):
    __slots__ = ("seconds", "version", "scales")
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    seconds: float
    version: int
    scales: bytes
    def __init__(self, seconds: _Optional[float] = ..., version: _Optional[int] = ..., scales: _Optional[bytes] = ...) -> None: ...
