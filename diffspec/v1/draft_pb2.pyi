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

class PrefixLookup(_message.Message):
    __slots__ = ("session_id", "prompt_ids", "cache_scope")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_scope: str
    def __init__(self, session_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., cache_scope: _Optional[str] = ...) -> None: ...

class DraftStart(_message.Message):
    __slots__ = ("session_id", "prompt_ids", "first_token", "options", "cached_positions")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    CACHED_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token: int
    options: DraftOptions
    cached_positions: int
    def __init__(self, session_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., first_token: _Optional[int] = ..., options: _Optional[_Union[DraftOptions, _Mapping]] = ..., cached_positions: _Optional[int] = ...) -> None: ...

class DraftAccept(_message.Message):
    __slots__ = ("session_id", "emitted_tokens", "verified_draft_tree")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_DRAFT_TREE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    emitted_tokens: _containers.RepeatedScalarFieldContainer[int]
    verified_draft_tree: bool
    def __init__(self, session_id: _Optional[str] = ..., emitted_tokens: _Optional[_Iterable[int]] = ..., verified_draft_tree: _Optional[bool] = ...) -> None: ...

class DraftStep(_message.Message):
    __slots__ = ("releases", "starts", "accepts", "proposes", "verify_rows", "verify_seconds", "feature_rows", "lookups")
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    STARTS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_FIELD_NUMBER: _ClassVar[int]
    PROPOSES_FIELD_NUMBER: _ClassVar[int]
    VERIFY_ROWS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_ROWS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    releases: _containers.RepeatedScalarFieldContainer[str]
    starts: _containers.RepeatedCompositeFieldContainer[DraftStart]
    accepts: _containers.RepeatedCompositeFieldContainer[DraftAccept]
    proposes: _containers.RepeatedScalarFieldContainer[str]
    verify_rows: int
    verify_seconds: float
    feature_rows: int
    lookups: _containers.RepeatedCompositeFieldContainer[PrefixLookup]
    def __init__(self, releases: _Optional[_Iterable[str]] = ..., starts: _Optional[_Iterable[_Union[DraftStart, _Mapping]]] = ..., accepts: _Optional[_Iterable[_Union[DraftAccept, _Mapping]]] = ..., proposes: _Optional[_Iterable[str]] = ..., verify_rows: _Optional[int] = ..., verify_seconds: _Optional[float] = ..., feature_rows: _Optional[int] = ..., lookups: _Optional[_Iterable[_Union[PrefixLookup, _Mapping]]] = ...) -> None: ...

class DraftStepRequest(_message.Message):
    __slots__ = ("step", "features")
    STEP_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    step: DraftStep
    features: _tensor_pb2.TensorChunk
    def __init__(self, step: _Optional[_Union[DraftStep, _Mapping]] = ..., features: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class ProposedTree(_message.Message):
    __slots__ = ("session_id", "tree")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tree: _tensor_pb2.DraftTree
    def __init__(self, session_id: _Optional[str] = ..., tree: _Optional[_Union[_tensor_pb2.DraftTree, _Mapping]] = ...) -> None: ...

class DraftStats(_message.Message):
    __slots__ = ("hazard", "working_set_tokens", "context_tokens", "working_set_updates")
    HAZARD_FIELD_NUMBER: _ClassVar[int]
    WORKING_SET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WORKING_SET_UPDATES_FIELD_NUMBER: _ClassVar[int]
    hazard: _containers.RepeatedScalarFieldContainer[float]
    working_set_tokens: int
    context_tokens: int
    working_set_updates: int
    def __init__(self, hazard: _Optional[_Iterable[float]] = ..., working_set_tokens: _Optional[int] = ..., context_tokens: _Optional[int] = ..., working_set_updates: _Optional[int] = ...) -> None: ...

class ReleasedSession(_message.Message):
    __slots__ = ("session_id", "stats")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    stats: DraftStats
    def __init__(self, session_id: _Optional[str] = ..., stats: _Optional[_Union[DraftStats, _Mapping]] = ...) -> None: ...

class CachedPrefix(_message.Message):
    __slots__ = ("session_id", "positions")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    positions: int
    def __init__(self, session_id: _Optional[str] = ..., positions: _Optional[int] = ...) -> None: ...

class DraftStepReply(_message.Message):
    __slots__ = ("trees", "released", "failures", "cached")
    TREES_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    trees: _containers.RepeatedCompositeFieldContainer[ProposedTree]
    released: _containers.RepeatedCompositeFieldContainer[ReleasedSession]
    failures: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.SessionFailure]
    cached: _containers.RepeatedCompositeFieldContainer[CachedPrefix]
    def __init__(self, trees: _Optional[_Iterable[_Union[ProposedTree, _Mapping]]] = ..., released: _Optional[_Iterable[_Union[ReleasedSession, _Mapping]]] = ..., failures: _Optional[_Iterable[_Union[_tensor_pb2.SessionFailure, _Mapping]]] = ..., cached: _Optional[_Iterable[_Union[CachedPrefix, _Mapping]]] = ...) -> None: ...

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
