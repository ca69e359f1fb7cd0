from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GetManifestRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class GetManifestResponse(_message.Message):
    __slots__ = ("version", "manifest")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    version: int
    manifest: bytes
    def __init__(self, version: _Optional[int] = ..., manifest: _Optional[bytes] = ...) -> None: ...

class StreamShardsRequest(_message.Message):
    __slots__ = ("version", "shard_index", "offset", "delta")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    version: int
    shard_index: int
    offset: int
    delta: bool
    def __init__(self, version: _Optional[int] = ..., shard_index: _Optional[int] = ..., offset: _Optional[int] = ..., delta: _Optional[bool] = ...) -> None: ...

class ShardChunk(_message.Message):
    __slots__ = ("version", "shard_index", "offset", "data", "last")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    version: int
    shard_index: int
    offset: int
    data: bytes
    last: bool
    def __init__(self, version: _Optional[int] = ..., shard_index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ...) -> None: ...
