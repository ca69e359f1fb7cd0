from fp8rl.rpc import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Prompt(_message.Message):
    __slots__ = ("token_ids", "text", "images")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    images: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., images: _Optional[_Iterable[bytes]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "max_tokens", "n", "seed", "stop_token_ids")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    max_tokens: int
    n: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., max_tokens: _Optional[int] = ..., n: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompts", "sampling", "weight_version", "session_keys", "max_weight_lag")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SESSION_KEYS_FIELD_NUMBER: _ClassVar[int]
    MAX_WEIGHT_LAG_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    sampling: SamplingParams
    weight_version: int
    session_keys: _containers.RepeatedScalarFieldContainer[str]
    max_weight_lag: int
    def __init__(self, request_id: _Optional[str] = ..., prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., weight_version: _Optional[int] = ..., session_keys: _Optional[_Iterable[str]] = ..., max_weight_lag: _Optional[int] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("prompt_index", "sample_index", "token_ids", "logprobs", "finish_reason", "weight_version", "routes")
    PROMPT_INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    prompt_index: int
    sample_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: str
    weight_version: int
    routes: _common_pb2.Routes
    def __init__(self, prompt_index: _Optional[int] = ..., sample_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[str] = ..., weight_version: _Optional[int] = ..., routes: _Optional[_Union[_common_pb2.Routes, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "sample")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sample: Sample
    def __init__(self, request_id: _Optional[str] = ..., sample: _Optional[_Union[Sample, _Mapping]] = ...) -> None: ...

class RolloutStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RolloutStatusResponse(_message.Message):
    __slots__ = ("weight_version", "scales_version", "replica_id", "engine", "recipe", "kv_cache_dtype", "ready", "pending_version", "pending_reason", "generating", "session_reused_tokens", "session_prefill_tokens", "session_evictions")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SCALES_VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    RECIPE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    PENDING_VERSION_FIELD_NUMBER: _ClassVar[int]
    PENDING_REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATING_FIELD_NUMBER: _ClassVar[int]
    SESSION_REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    scales_version: int
    replica_id: str
    engine: str
    recipe: str
    kv_cache_dtype: str
    ready: bool
    pending_version: int
    pending_reason: str
    generating: int
    session_reused_tokens: int
    session_prefill_tokens: int
    session_evictions: int
    def __init__(self, weight_version: _Optional[int] = ..., scales_version: _Optional[int] = ..., replica_id: _Optional[str] = ..., engine: _Optional[str] = ..., recipe: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., ready: _Optional[bool] = ..., pending_version: _Optional[int] = ..., pending_reason: _Optional[str] = ..., generating: _Optional[int] = ..., session_reused_tokens: _Optional[int] = ..., session_prefill_tokens: _Optional[int] = ..., session_evictions: _Optional[int] = ...) -> None: ...

class ReleaseSessionsRequest(_message.Message):
    __slots__ = ("session_keys",)
    SESSION_KEYS_FIELD_NUMBER: _ClassVar[int]
    session_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_keys: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseSessionsResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...
