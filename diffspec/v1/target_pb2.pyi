from diffspec.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("prompt_ids", "sampling", "want_features")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    WANT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: Sampling
    want_features: bool
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., want_features: _Optional[bool] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("tree",)
    TREE_FIELD_NUMBER: _ClassVar[int]
    tree: _tensor_pb2.DraftTree
    def __init__(self, tree: _Optional[_Union[_tensor_pb2.DraftTree, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetReleaseRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetRequest(_message.Message):
    __slots__ = ("prefill", "verify", "decode", "release")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    prefill: PrefillRequest
    verify: VerifyRequest
    decode: DecodeRequest
    release: TargetReleaseRequest
    def __init__(self, prefill: _Optional[_Union[PrefillRequest, _Mapping]] = ..., verify: _Optional[_Union[VerifyRequest, _Mapping]] = ..., decode: _Optional[_Union[DecodeRequest, _Mapping]] = ..., release: _Optional[_Union[TargetReleaseRequest, _Mapping]] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("first_token", "num_cached_tokens", "feature_rows")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_ROWS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    num_cached_tokens: int
    feature_rows: int
    def __init__(self, first_token: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., feature_rows: _Optional[int] = ...) -> None: ...

class StepReply(_message.Message):
    __slots__ = ("accepted_tokens", "accepted_nodes", "bonus_token", "features")
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NODES_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    accepted_tokens: _containers.RepeatedScalarFieldContainer[int]
    accepted_nodes: _containers.RepeatedScalarFieldContainer[int]
    bonus_token: int
    features: _tensor_pb2.Tensor
    def __init__(self, accepted_tokens: _Optional[_Iterable[int]] = ..., accepted_nodes: _Optional[_Iterable[int]] = ..., bonus_token: _Optional[int] = ..., features: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class TargetReleaseReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetResponse(_message.Message):
    __slots__ = ("prefill", "features", "step", "release")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    prefill: PrefillReply
    features: _tensor_pb2.TensorChunk
    step: StepReply
    release: TargetReleaseReply
    def __init__(self, prefill: _Optional[_Union[PrefillReply, _Mapping]] = ..., features: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ..., step: _Optional[_Union[StepReply, _Mapping]] = ..., release: _Optional[_Union[TargetReleaseReply, _Mapping]] = ...) -> None: ...

class TargetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetInfoResponse(_message.Message):
    __slots__ = ("model", "vocab_size", "hidden_size", "num_layers", "feature_layers", "eos_token_ids", "max_context", "page_size", "num_pages", "num_free_pages", "active_sessions", "device", "dtype", "queue_depth")
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
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
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
    queue_depth: int
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., feature_layers: _Optional[_Iterable[int]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_context: _Optional[int] = ..., page_size: _Optional[int] = ..., num_pages: _Optional[int] = ..., num_free_pages: _Optional[int] = ..., active_sessions: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., queue_depth: _Optional[int] = ...) -> None: ...
