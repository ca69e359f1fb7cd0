from fp8rl.rpc import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitJobRequest(_message.Message):
    __slots__ = ("job_yaml", "job_id")
    JOB_YAML_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_yaml: str
    job_id: str
    def __init__(self, job_yaml: _Optional[str] = ..., job_id: _Optional[str] = ...) -> None: ...

class SubmitJobResponse(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("job_id", "from_step")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    from_step: int
    def __init__(self, job_id: _Optional[str] = ..., from_step: _Optional[int] = ...) -> None: ...

class StepReport(_message.Message):
    __slots__ = ("job_id", "step", "weight_version", "reward_mean", "accuracy", "metrics", "phase_times", "state", "trajectories_md", "pictures")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    PHASE_TIMES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_MD_FIELD_NUMBER: _ClassVar[int]
    PICTURES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    weight_version: int
    reward_mean: float
    accuracy: float
    metrics: _containers.ScalarMap[str, float]
    phase_times: _common_pb2.PhaseTimes
    state: str
    trajectories_md: str
    pictures: _containers.RepeatedCompositeFieldContainer[ReportPicture]
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., weight_version: _Optional[int] = ..., reward_mean: _Optional[float] = ..., accuracy: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ..., phase_times: _Optional[_Union[_common_pb2.PhaseTimes, _Mapping]] = ..., state: _Optional[str] = ..., trajectories_md: _Optional[str] = ..., pictures: _Optional[_Iterable[_Union[ReportPicture, _Mapping]]] = ...) -> None: ...

class ReportPicture(_message.Message):
    __slots__ = ("images", "prompt", "reference", "sampled", "right")
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    RIGHT_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedScalarFieldContainer[bytes]
    prompt: str
    reference: str
    sampled: str
    right: bool
    def __init__(self, images: _Optional[_Iterable[bytes]] = ..., prompt: _Optional[str] = ..., reference: _Optional[str] = ..., sampled: _Optional[str] = ..., right: _Optional[bool] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class JobInfo(_message.Message):
    __slots__ = ("job_id", "state", "step", "total_steps", "error", "created_unix", "updated_unix")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: str
    step: int
    total_steps: int
    error: str
    created_unix: float
    updated_unix: float
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[str] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., error: _Optional[str] = ..., created_unix: _Optional[float] = ..., updated_unix: _Optional[float] = ...) -> None: ...

class GetJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: JobInfo
    def __init__(self, job: _Optional[_Union[JobInfo, _Mapping]] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("state", "limit", "page_token")
    STATE_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    state: str
    limit: int
    page_token: str
    def __init__(self, state: _Optional[str] = ..., limit: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobInfo]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: JobInfo
    def __init__(self, job: _Optional[_Union[JobInfo, _Mapping]] = ...) -> None: ...
