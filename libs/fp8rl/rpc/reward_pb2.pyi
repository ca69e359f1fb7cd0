from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GradeStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GRADE_STATUS_UNSPECIFIED: _ClassVar[GradeStatus]
    GRADE_STATUS_GRADED: _ClassVar[GradeStatus]
    GRADE_STATUS_UNPARSABLE: _ClassVar[GradeStatus]
    GRADE_STATUS_TIMEOUT: _ClassVar[GradeStatus]
    GRADE_STATUS_ERROR: _ClassVar[GradeStatus]
GRADE_STATUS_UNSPECIFIED: GradeStatus
GRADE_STATUS_GRADED: GradeStatus
GRADE_STATUS_UNPARSABLE: GradeStatus
GRADE_STATUS_TIMEOUT: GradeStatus
GRADE_STATUS_ERROR: GradeStatus

class ModelItem(_message.Message):
    __slots__ = ("question", "response", "answer", "other")
    QUESTION_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    OTHER_FIELD_NUMBER: _ClassVar[int]
    question: str
    response: str
    answer: str
    other: str
    def __init__(self, question: _Optional[str] = ..., response: _Optional[str] = ..., answer: _Optional[str] = ..., other: _Optional[str] = ...) -> None: ...

class ScoreModelRequest(_message.Message):
    __slots__ = ("items", "timeout_s")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ModelItem]
    timeout_s: float
    def __init__(self, items: _Optional[_Iterable[_Union[ModelItem, _Mapping]]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class ModelScore(_message.Message):
    __slots__ = ("scored", "score", "error", "tokens", "unparsable", "compared", "reference_scored", "reference")
    SCORED_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    UNPARSABLE_FIELD_NUMBER: _ClassVar[int]
    COMPARED_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_SCORED_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    scored: bool
    score: float
    error: str
    tokens: int
    unparsable: int
    compared: bool
    reference_scored: bool
    reference: float
    def __init__(self, scored: _Optional[bool] = ..., score: _Optional[float] = ..., error: _Optional[str] = ..., tokens: _Optional[int] = ..., unparsable: _Optional[int] = ..., compared: _Optional[bool] = ..., reference_scored: _Optional[bool] = ..., reference: _Optional[float] = ...) -> None: ...

class ScoreModelResponse(_message.Message):
    __slots__ = ("scores", "model")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[ModelScore]
    model: str
    def __init__(self, scores: _Optional[_Iterable[_Union[ModelScore, _Mapping]]] = ..., model: _Optional[str] = ...) -> None: ...

class ScoreItem(_message.Message):
    __slots__ = ("response", "answer", "grader")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    GRADER_FIELD_NUMBER: _ClassVar[int]
    response: str
    answer: str
    grader: str
    def __init__(self, response: _Optional[str] = ..., answer: _Optional[str] = ..., grader: _Optional[str] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScoreItem]
    def __init__(self, items: _Optional[_Iterable[_Union[ScoreItem, _Mapping]]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("rewards", "num_unparsable", "errors", "statuses")
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    NUM_UNPARSABLE_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    rewards: _containers.RepeatedScalarFieldContainer[float]
    num_unparsable: int
    errors: _containers.RepeatedScalarFieldContainer[str]
    statuses: _containers.RepeatedScalarFieldContainer[GradeStatus]
    def __init__(self, rewards: _Optional[_Iterable[float]] = ..., num_unparsable: _Optional[int] = ..., errors: _Optional[_Iterable[str]] = ..., statuses: _Optional[_Iterable[_Union[GradeStatus, str]]] = ...) -> None: ...
