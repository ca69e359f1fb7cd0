from fp8rl.rpc import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Sequence(_message.Message):
    __slots__ = ("prompt_ids", "response_ids", "gen_logprobs", "advantage", "weight_version", "routes", "loss_mask", "image_indices")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    GEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    IMAGE_INDICES_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    response_ids: _containers.RepeatedScalarFieldContainer[int]
    gen_logprobs: _containers.RepeatedScalarFieldContainer[float]
    advantage: float
    weight_version: int
    routes: _common_pb2.Routes
    loss_mask: _containers.RepeatedScalarFieldContainer[bool]
    image_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., response_ids: _Optional[_Iterable[int]] = ..., gen_logprobs: _Optional[_Iterable[float]] = ..., advantage: _Optional[float] = ..., weight_version: _Optional[int] = ..., routes: _Optional[_Union[_common_pb2.Routes, _Mapping]] = ..., loss_mask: _Optional[_Iterable[bool]] = ..., image_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class TrainStepRequest(_message.Message):
    __slots__ = ("expected_version", "rows", "step", "max_weight_lag", "calibrate_scales", "scales_from_logprobs", "images")
    EXPECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_WEIGHT_LAG_FIELD_NUMBER: _ClassVar[int]
    CALIBRATE_SCALES_FIELD_NUMBER: _ClassVar[int]
    SCALES_FROM_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    expected_version: int
    rows: _containers.RepeatedCompositeFieldContainer[Sequence]
    step: int
    max_weight_lag: int
    calibrate_scales: bool
    scales_from_logprobs: bool
    images: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, expected_version: _Optional[int] = ..., rows: _Optional[_Iterable[_Union[Sequence, _Mapping]]] = ..., step: _Optional[int] = ..., max_weight_lag: _Optional[int] = ..., calibrate_scales: _Optional[bool] = ..., scales_from_logprobs: _Optional[bool] = ..., images: _Optional[_Iterable[bytes]] = ...) -> None: ...

class TrainStepResponse(_message.Message):
    __slots__ = ("new_version", "metrics", "phase_times")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NEW_VERSION_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    PHASE_TIMES_FIELD_NUMBER: _ClassVar[int]
    new_version: int
    metrics: _containers.ScalarMap[str, float]
    phase_times: _common_pb2.PhaseTimes
    def __init__(self, new_version: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., phase_times: _Optional[_Union[_common_pb2.PhaseTimes, _Mapping]] = ...) -> None: ...

class ComputeLogprobsRequest(_message.Message):
    __slots__ = ("rows", "expected_version", "images")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[Sequence]
    expected_version: int
    images: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, rows: _Optional[_Iterable[_Union[Sequence, _Mapping]]] = ..., expected_version: _Optional[int] = ..., images: _Optional[_Iterable[bytes]] = ...) -> None: ...

class RowLogprobs(_message.Message):
    __slots__ = ("logprobs",)
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ComputeLogprobsResponse(_message.Message):
    __slots__ = ("rows", "metrics", "version")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ROWS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[RowLogprobs]
    metrics: _containers.ScalarMap[str, float]
    version: int
    def __init__(self, rows: _Optional[_Iterable[_Union[RowLogprobs, _Mapping]]] = ..., metrics: _Optional[_Mapping[str, float]] = ..., version: _Optional[int] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("path", "name")
    PATH_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    path: str
    name: str
    def __init__(self, path: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class SaveCheckpointResponse(_message.Message):
    __slots__ = ("path", "version", "file")
    PATH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    path: str
    version: int
    file: str
    def __init__(self, path: _Optional[str] = ..., version: _Optional[int] = ..., file: _Optional[str] = ...) -> None: ...

class TrainerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TrainerStatusResponse(_message.Message):
    __slots__ = ("version", "backend", "recipe", "weights_endpoint", "ready")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    RECIPE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    version: int
    backend: str
    recipe: str
    weights_endpoint: str
    ready: bool
    def __init__(self, version: _Optional[int] = ..., backend: _Optional[str] = ..., recipe: _Optional[str] = ..., weights_endpoint: _Optional[str] = ..., ready: _Optional[bool] = ...) -> None: ...
