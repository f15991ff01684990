from diffspec.v1 import logprobs_pb2 as _logprobs_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "max_new_tokens", "temperature", "top_p", "seed", "stop", "policy", "tree_config", "salience", "top_k", "logprobs", "n", "stop_token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    TREE_CONFIG_FIELD_NUMBER: _ClassVar[int]
    SALIENCE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    policy: str
    tree_config: str
    salience: bool
    top_k: int
    logprobs: int
    n: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., policy: _Optional[str] = ..., tree_config: _Optional[str] = ..., salience: _Optional[bool] = ..., top_k: _Optional[int] = ..., logprobs: _Optional[int] = ..., n: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("prompt_tokens", "new_tokens", "steps", "accepted_drafts", "mean_accepted_length", "stop_depth_histogram", "prefill_seconds", "draft_seconds", "verify_seconds", "decode_seconds", "decode_tokens_per_second", "finish_reason", "fell_back_to_auto", "hazard", "working_set_tokens", "working_set_updates")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    STOP_DEPTH_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    FELL_BACK_TO_AUTO_FIELD_NUMBER: _ClassVar[int]
    HAZARD_FIELD_NUMBER: _ClassVar[int]
    WORKING_SET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WORKING_SET_UPDATES_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    new_tokens: int
    steps: int
    accepted_drafts: int
    mean_accepted_length: float
    stop_depth_histogram: _containers.RepeatedScalarFieldContainer[int]
    prefill_seconds: float
    draft_seconds: float
    verify_seconds: float
    decode_seconds: float
    decode_tokens_per_second: float
    finish_reason: str
    fell_back_to_auto: bool
    hazard: _containers.RepeatedScalarFieldContainer[float]
    working_set_tokens: int
    working_set_updates: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., new_tokens: _Optional[int] = ..., steps: _Optional[int] = ..., accepted_drafts: _Optional[int] = ..., mean_accepted_length: _Optional[float] = ..., stop_depth_histogram: _Optional[_Iterable[int]] = ..., prefill_seconds: _Optional[float] = ..., draft_seconds: _Optional[float] = ..., verify_seconds: _Optional[float] = ..., decode_seconds: _Optional[float] = ..., decode_tokens_per_second: _Optional[float] = ..., finish_reason: _Optional[str] = ..., fell_back_to_auto: _Optional[bool] = ..., hazard: _Optional[_Iterable[float]] = ..., working_set_tokens: _Optional[int] = ..., working_set_updates: _Optional[int] = ...) -> None: ...

class PrefillProgress(_message.Message):
    __slots__ = ("done_tokens", "total_tokens")
    DONE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    done_tokens: int
    total_tokens: int
    def __init__(self, done_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "stats", "prefill_progress", "logprobs", "index")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    stats: GenerationStats
    prefill_progress: PrefillProgress
    logprobs: _logprobs_pb2.TokenLogprobs
    index: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., prefill_progress: _Optional[_Union[PrefillProgress, _Mapping]] = ..., logprobs: _Optional[_Union[_logprobs_pb2.TokenLogprobs, _Mapping]] = ..., index: _Optional[int] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfoResponse(_message.Message):
    __slots__ = ("target_model", "vocab_size", "max_context", "eos_token_ids", "draft_available", "default_policy", "default_tree_config", "max_sessions")
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_POLICY_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_TREE_CONFIG_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    target_model: str
    vocab_size: int
    max_context: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_available: bool
    default_policy: str
    default_tree_config: str
    max_sessions: int
    def __init__(self, target_model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., draft_available: _Optional[bool] = ..., default_policy: _Optional[str] = ..., default_tree_config: _Optional[str] = ..., max_sessions: _Optional[int] = ...) -> None: ...
