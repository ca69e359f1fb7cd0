from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EnvStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENV_STATUS_UNSPECIFIED: _ClassVar[EnvStatus]
    ENV_STATUS_OK: _ClassVar[EnvStatus]
    ENV_STATUS_ERROR: _ClassVar[EnvStatus]
    ENV_STATUS_TIMEOUT: _ClassVar[EnvStatus]
    ENV_STATUS_LOST: _ClassVar[EnvStatus]

class AgentEnd(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AGENT_END_UNSPECIFIED: _ClassVar[AgentEnd]
    AGENT_END_DONE: _ClassVar[AgentEnd]
    AGENT_END_ERROR: _ClassVar[AgentEnd]
    AGENT_END_TIMEOUT: _ClassVar[AgentEnd]
ENV_STATUS_UNSPECIFIED: EnvStatus
ENV_STATUS_OK: EnvStatus
ENV_STATUS_ERROR: EnvStatus
ENV_STATUS_TIMEOUT: EnvStatus
ENV_STATUS_LOST: EnvStatus
AGENT_END_UNSPECIFIED: AgentEnd
AGENT_END_DONE: AgentEnd
AGENT_END_ERROR: AgentEnd
AGENT_END_TIMEOUT: AgentEnd

class EnvResetRequest(_message.Message):
    __slots__ = ("trajectory_id", "env", "kwargs_json", "task_json")
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    TASK_JSON_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    env: str
    kwargs_json: str
    task_json: str
    def __init__(self, trajectory_id: _Optional[str] = ..., env: _Optional[str] = ..., kwargs_json: _Optional[str] = ..., task_json: _Optional[str] = ...) -> None: ...

class EnvResetResponse(_message.Message):
    __slots__ = ("messages_json", "tools_json")
    MESSAGES_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    messages_json: str
    tools_json: str
    def __init__(self, messages_json: _Optional[str] = ..., tools_json: _Optional[str] = ...) -> None: ...

class EnvStepRequest(_message.Message):
    __slots__ = ("trajectory_id", "text", "timeout_s")
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    text: str
    timeout_s: float
    def __init__(self, trajectory_id: _Optional[str] = ..., text: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class EnvStepResponse(_message.Message):
    __slots__ = ("status", "messages_json", "reward", "done", "info_json", "error")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_JSON_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    status: EnvStatus
    messages_json: str
    reward: float
    done: bool
    info_json: str
    error: str
    def __init__(self, status: _Optional[_Union[EnvStatus, str]] = ..., messages_json: _Optional[str] = ..., reward: _Optional[float] = ..., done: _Optional[bool] = ..., info_json: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class EnvCloseRequest(_message.Message):
    __slots__ = ("trajectory_ids",)
    TRAJECTORY_IDS_FIELD_NUMBER: _ClassVar[int]
    trajectory_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, trajectory_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class EnvCloseResponse(_message.Message):
    __slots__ = ("closed",)
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    closed: int
    def __init__(self, closed: _Optional[int] = ...) -> None: ...

class AgentTask(_message.Message):
    __slots__ = ("session_id", "task_json", "base_url")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_JSON_FIELD_NUMBER: _ClassVar[int]
    BASE_URL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    task_json: str
    base_url: str
    def __init__(self, session_id: _Optional[str] = ..., task_json: _Optional[str] = ..., base_url: _Optional[str] = ...) -> None: ...

class RunAgentsRequest(_message.Message):
    __slots__ = ("entrypoint", "tasks", "timeout_s", "concurrency", "temperature", "top_p", "grader", "max_tokens_per_call")
    ENTRYPOINT_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    GRADER_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_CALL_FIELD_NUMBER: _ClassVar[int]
    entrypoint: str
    tasks: _containers.RepeatedCompositeFieldContainer[AgentTask]
    timeout_s: float
    concurrency: int
    temperature: float
    top_p: float
    grader: str
    max_tokens_per_call: int
    def __init__(self, entrypoint: _Optional[str] = ..., tasks: _Optional[_Iterable[_Union[AgentTask, _Mapping]]] = ..., timeout_s: _Optional[float] = ..., concurrency: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., grader: _Optional[str] = ..., max_tokens_per_call: _Optional[int] = ...) -> None: ...

class AgentOutcome(_message.Message):
    __slots__ = ("session_id", "end", "graded", "reward", "error", "token_ids", "logprobs", "loss_mask", "weight_versions", "turns", "tool_calls")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    GRADED_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    end: AgentEnd
    graded: bool
    reward: float
    error: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    loss_mask: bytes
    weight_versions: _containers.RepeatedScalarFieldContainer[int]
    turns: int
    tool_calls: int
    def __init__(self, session_id: _Optional[str] = ..., end: _Optional[_Union[AgentEnd, str]] = ..., graded: _Optional[bool] = ..., reward: _Optional[float] = ..., error: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., loss_mask: _Optional[bytes] = ..., weight_versions: _Optional[_Iterable[int]] = ..., turns: _Optional[int] = ..., tool_calls: _Optional[int] = ...) -> None: ...

class RunAgentsResponse(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[AgentOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[AgentOutcome, _Mapping]]] = ...) -> None: ...
