from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class TensorHeader(_message.Message):
    __slots__ = ("name", "dtype", "shape", "block_size", "nbytes", "checksum", "scale_name")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    SCALE_NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    block_size: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    checksum: str
    scale_name: str
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., block_size: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., checksum: _Optional[str] = ..., scale_name: _Optional[str] = ...) -> None: ...

class PhaseTimes(_message.Message):
    __slots__ = ("rollout", "reward", "logprobs", "train", "publish", "calibrate", "refit", "total", "outage")
    ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_FIELD_NUMBER: _ClassVar[int]
    CALIBRATE_FIELD_NUMBER: _ClassVar[int]
    REFIT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    OUTAGE_FIELD_NUMBER: _ClassVar[int]
    rollout: float
    reward: float
    logprobs: float
    train: float
    publish: float
    calibrate: float
    refit: float
    total: float
    outage: float
    def __init__(self, rollout: _Optional[float] = ..., reward: _Optional[float] = ..., logprobs: _Optional[float] = ..., train: _Optional[float] = ..., publish: _Optional[float] = ..., calibrate: _Optional[float] = ..., refit: _Optional[float] = ..., total: _Optional[float] = ..., outage: _Optional[float] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("token_ids", "image_indices")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_INDICES_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    image_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., image_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class Routes(_message.Message):
    __slots__ = ("ids", "dtype", "layers", "top_k")
    IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    ids: bytes
    dtype: str
    layers: int
    top_k: int
    def __init__(self, ids: _Optional[bytes] = ..., dtype: _Optional[str] = ..., layers: _Optional[int] = ..., top_k: _Optional[int] = ...) -> None: ...
