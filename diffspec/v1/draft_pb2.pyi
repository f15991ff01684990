from diffspec.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftOptions(_message.Message):
    __slots__ = ("policy", "tree_config", "salience")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    TREE_CONFIG_FIELD_NUMBER: _ClassVar[int]
    SALIENCE_FIELD_NUMBER: _ClassVar[int]
    policy: str
    tree_config: str
    salience: bool
    def __init__(self, policy: _Optional[str] = ..., tree_config: _Optional[str] = ..., salience: _Optional[bool] = ...) -> None: ...

class StartRequest(_message.Message):
    __slots__ = ("prompt_ids", "first_token", "options", "feature_rows")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_ROWS_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token: int
    options: DraftOptions
    feature_rows: int
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., first_token: _Optional[int] = ..., options: _Optional[_Union[DraftOptions, _Mapping]] = ..., feature_rows: _Optional[int] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AcceptRequest(_message.Message):
    __slots__ = ("emitted_tokens", "features")
    EMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    emitted_tokens: _containers.RepeatedScalarFieldContainer[int]
    features: _tensor_pb2.Tensor
    def __init__(self, emitted_tokens: _Optional[_Iterable[int]] = ..., features: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftReleaseRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("start", "features", "propose", "accept", "stats", "release")
    START_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    start: StartRequest
    features: _tensor_pb2.TensorChunk
    propose: ProposeRequest
    accept: AcceptRequest
    stats: StatsRequest
    release: DraftReleaseRequest
    def __init__(self, start: _Optional[_Union[StartRequest, _Mapping]] = ..., features: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ..., propose: _Optional[_Union[ProposeRequest, _Mapping]] = ..., accept: _Optional[_Union[AcceptRequest, _Mapping]] = ..., stats: _Optional[_Union[StatsRequest, _Mapping]] = ..., release: _Optional[_Union[DraftReleaseRequest, _Mapping]] = ...) -> None: ...

class StartReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProposeReply(_message.Message):
    __slots__ = ("tree",)
    TREE_FIELD_NUMBER: _ClassVar[int]
    tree: _tensor_pb2.DraftTree
    def __init__(self, tree: _Optional[_Union[_tensor_pb2.DraftTree, _Mapping]] = ...) -> None: ...

class AcceptReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("hazard", "working_set_tokens", "context_tokens")
    HAZARD_FIELD_NUMBER: _ClassVar[int]
    WORKING_SET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    hazard: _containers.RepeatedScalarFieldContainer[float]
    working_set_tokens: int
    context_tokens: int
    def __init__(self, hazard: _Optional[_Iterable[float]] = ..., working_set_tokens: _Optional[int] = ..., context_tokens: _Optional[int] = ...) -> None: ...

class DraftReleaseReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("start", "propose", "accept", "stats", "release")
    START_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    start: StartReply
    propose: ProposeReply
    accept: AcceptReply
    stats: StatsReply
    release: DraftReleaseReply
    def __init__(self, start: _Optional[_Union[StartReply, _Mapping]] = ..., propose: _Optional[_Union[ProposeReply, _Mapping]] = ..., accept: _Optional[_Union[AcceptReply, _Mapping]] = ..., stats: _Optional[_Union[StatsReply, _Mapping]] = ..., release: _Optional[_Union[DraftReleaseReply, _Mapping]] = ...) -> None: ...

class DraftInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftInfoResponse(_message.Message):
    __slots__ = ("model", "vocab_size", "draft_vocab_size", "target_hidden_size", "feature_layers", "max_positions", "active_sessions", "device", "dtype")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TARGET_HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    feature_layers: _containers.RepeatedScalarFieldContainer[int]
    max_positions: int
    active_sessions: int
    device: str
    dtype: str
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., draft_vocab_size: _Optional[int] = ..., target_hidden_size: _Optional[int] = ..., feature_layers: _Optional[_Iterable[int]] = ..., max_positions: _Optional[int] = ..., active_sessions: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ...) -> None: ...
