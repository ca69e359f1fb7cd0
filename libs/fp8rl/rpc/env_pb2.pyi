from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EnvStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENV_STATUS_UNSPECIFIED: _ClassVar[EnvStatus]
    ENV_STATUS_OK: _ClassVar[EnvStatus]
    ENV_STATUS_ERROR: _ClassVar[EnvStatus]
    ENV_STATUS_TIMEOUT: _ClassVar[EnvStatus]
    ENV_STATUS_LOST: _ClassVar[EnvStatus]
ENV_STATUS_UNSPECIFIED: EnvStatus
ENV_STATUS_OK: EnvStatus
ENV_STATUS_ERROR: EnvStatus
ENV_STATUS_TIMEOUT: EnvStatus
ENV_STATUS_LOST: EnvStatus

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
