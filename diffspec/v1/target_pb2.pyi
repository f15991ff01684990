from diffspec.v1 import logprobs_pb2 as _logprobs_pb2
from diffspec.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "seed", "top_k", "logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    seed: int
    top_k: int
    logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., top_k: _Optional[int] = ..., logprobs: _Optional[int] = ...) -> None: ...

class SessionOpen(_message.Message):
    __slots__ = ("session_id", "prompt_ids", "sampling", "want_features", "cache_scope", "feature_layers", "fork_of", "features_from")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    WANT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    FORK_OF_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FROM_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: Sampling
    want_features: bool
    cache_scope: str
    feature_layers: _containers.RepeatedScalarFieldContainer[int]
    fork_of: str
    features_from: int
    def __init__(self, session_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., want_features: _Optional[bool] = ..., cache_scope: _Optional[str] = ..., feature_layers: _Optional[_Iterable[int]] = ..., fork_of: _Optional[str] = ..., features_from: _Optional[int] = ...) -> None: ...

class PrefillWork(_message.Message):
    __slots__ = ("session_id", "num_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    num_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class VerifyWork(_message.Message):
    __slots__ = ("session_id", "tree")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tree: _tensor_pb2.DraftTree
    def __init__(self, session_id: _Optional[str] = ..., tree: _Optional[_Union[_tensor_pb2.DraftTree, _Mapping]] = ...) -> None: ...

class TargetStep(_message.Message):
    __slots__ = ("releases", "opens", "prefills", "verifies", "first_tokens_next_step", "collects")
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    OPENS_FIELD_NUMBER: _ClassVar[int]
    PREFILLS_FIELD_NUMBER: _ClassVar[int]
    VERIFIES_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKENS_NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    COLLECTS_FIELD_NUMBER: _ClassVar[int]
    releases: _containers.RepeatedScalarFieldContainer[str]
    opens: _containers.RepeatedCompositeFieldContainer[SessionOpen]
    prefills: _containers.RepeatedCompositeFieldContainer[PrefillWork]
    verifies: _containers.RepeatedCompositeFieldContainer[VerifyWork]
    first_tokens_next_step: bool
    collects: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, releases: _Optional[_Iterable[str]] = ..., opens: _Optional[_Iterable[_Union[SessionOpen, _Mapping]]] = ..., prefills: _Optional[_Iterable[_Union[PrefillWork, _Mapping]]] = ..., verifies: _Optional[_Iterable[_Union[VerifyWork, _Mapping]]] = ..., first_tokens_next_step: _Optional[bool] = ..., collects: _Optional[_Iterable[str]] = ...) -> None: ...

class PrefillDone(_message.Message):
    __slots__ = ("session_id", "done_tokens", "total_tokens", "first_token", "feature_rows", "first_logprobs")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DONE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FEATURE_ROWS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    done_tokens: int
    total_tokens: int
    first_token: int
    feature_rows: int
    first_logprobs: _logprobs_pb2.TokenLogprobs
    def __init__(self, session_id: _Optional[str] = ..., done_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., first_token: _Optional[int] = ..., feature_rows: _Optional[int] = ..., first_logprobs: _Optional[_Union[_logprobs_pb2.TokenLogprobs, _Mapping]] = ...) -> None: ...

class VerifyDone(_message.Message):
    __slots__ = ("session_id", "accepted_tokens", "accepted_nodes", "bonus_token", "feature_rows", "logprobs")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NODES_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FEATURE_ROWS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    accepted_tokens: _containers.RepeatedScalarFieldContainer[int]
    accepted_nodes: _containers.RepeatedScalarFieldContainer[int]
    bonus_token: int
    feature_rows: int
    logprobs: _logprobs_pb2.TokenLogprobs
    def __init__(self, session_id: _Optional[str] = ..., accepted_tokens: _Optional[_Iterable[int]] = ..., accepted_nodes: _Optional[_Iterable[int]] = ..., bonus_token: _Optional[int] = ..., feature_rows: _Optional[int] = ..., logprobs: _Optional[_Union[_logprobs_pb2.TokenLogprobs, _Mapping]] = ...) -> None: ...

class TargetStepReply(_message.Message):
    __slots__ = ("prefills", "verifies", "failures", "feature_rows", "num_free_pages")
    PREFILLS_FIELD_NUMBER: _ClassVar[int]
    VERIFIES_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    FEATURE_ROWS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    prefills: _containers.RepeatedCompositeFieldContainer[PrefillDone]
    verifies: _containers.RepeatedCompositeFieldContainer[VerifyDone]
    failures: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.SessionFailure]
    feature_rows: int
    num_free_pages: int
    def __init__(self, prefills: _Optional[_Iterable[_Union[PrefillDone, _Mapping]]] = ..., verifies: _Optional[_Iterable[_Union[VerifyDone, _Mapping]]] = ..., failures: _Optional[_Iterable[_Union[_tensor_pb2.SessionFailure, _Mapping]]] = ..., feature_rows: _Optional[int] = ..., num_free_pages: _Optional[int] = ...) -> None: ...

class TargetStepResponse(_message.Message):
    __slots__ = ("reply", "features")
    REPLY_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    reply: TargetStepReply
    features: _tensor_pb2.TensorChunk
    def __init__(self, reply: _Optional[_Union[TargetStepReply, _Mapping]] = ..., features: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class TargetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetInfoResponse(_message.Message):
    __slots__ = ("model", "vocab_size", "hidden_size", "num_layers", "feature_layers", "eos_token_ids", "max_context", "page_size", "num_pages", "num_free_pages", "active_sessions", "device", "dtype")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    feature_layers: _containers.RepeatedScalarFieldContainer[int]
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_context: int
    page_size: int
    num_pages: int
    num_free_pages: int
    active_sessions: int
    device: str
    dtype: str
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., feature_layers: _Optional[_Iterable[int]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_context: _Optional[int] = ..., page_size: _Optional[int] = ..., num_pages: _Optional[int] = ..., num_free_pages: _Optional[int] = ..., active_sessions: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ...) -> None: ...
