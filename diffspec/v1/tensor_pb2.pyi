from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("rows", "row_offset", "total_rows")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ROW_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: Tensor
    row_offset: int
    total_rows: int
    def __init__(self, rows: _Optional[_Union[Tensor, _Mapping]] = ..., row_offset: _Optional[int] = ..., total_rows: _Optional[int] = ...) -> None: ...

class DraftTree(_message.Message):
    __slots__ = ("tokens", "parents", "draft_probs")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[float]] = ...) -> None: ...

class SessionFailure(_message.Message):
    __slots__ = ("session_id", "code", "message")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    code: int
    message: str
    def __init__(self, session_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...
