"""Gateway messages <-> the engine's request/chunk/stats dataclasses.

What is checked here is the message itself (a prompt to read, stop sequences and ids, n, a tree config
given with Auto); what the target could not serve (the prompt's length and vocabulary,
max_new_tokens, the draft options) is checked once for every front end by the engine
(``SpeculativeEngine.check``), before any service sees it.

Defaults are applied here alone, for every front end: a sampling field the message leaves unset
(temperature, top_p, top_k) takes the checkpoint's generation_config.json value
(``SpeculativeEngine.sampling_defaults``), else the front end's own; one it sets wins. An unset
max_new_tokens takes the checkpoint's too, within what the prompt leaves of the target's context
(vLLM's ``max_model_len - prompt``), else the server's ``--max-new-tokens``.
"""

from __future__ import annotations

from typing import TypeVar

from diffspec.errors import InvalidRequest
from diffspec.sampling_params import SamplingDefaults, SamplingParams
from diffspec.settings import DiffSpecSettings
from diffspec.v1 import gateway_pb2
from diffspec.wire import logprobs_from_proto, logprobs_to_proto
from draft_service.options import DraftOptions
from draft_service.tree_budget import TreeBudget
from draft_service.tuned_profile import request_defaults
from gateway.request import GenerationChunk, GenerationRequest, GenerationStats

MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_SAMPLES = 16  # most samples (n) one request may ask for

Number = TypeVar("Number", int, float)


def prompt_text(message: gateway_pb2.GenerateRequest) -> str | None:
    """The prompt text, or None when the request carries token ids; a request with neither is rejected."""
    which = message.WhichOneof("prompt")
    if which is None:
        raise InvalidRequest("the request has no prompt: set text or token_ids")
    if which == "text":
        if not message.text:
            raise InvalidRequest("the prompt is empty")
        return message.text
    return None


def generation_request(
    message: gateway_pb2.GenerateRequest,
    prompt_ids: list[int],
    defaults: DiffSpecSettings,
    draft_available: bool = True,
    checkpoint: SamplingDefaults = SamplingDefaults(),
    default_temperature: float = 0.0,
    max_context: int = 0,
) -> GenerationRequest:
    """The engine request for ``message``; unset fields take the server's defaults (without a draft, a
    request that names no policy is Auto whatever the default policy). ``checkpoint``: the engine's
    ``sampling_defaults``; ``default_temperature``: the front end's own (HTTP: OpenAI's 1); ``max_context``:
    the target's, in tokens, which caps the checkpoint's max_new_tokens (0 = no cap)."""
    max_new_tokens = _max_new_tokens(message, len(prompt_ids), defaults, checkpoint, max_context)
    stops = tuple(message.stop)
    if len(stops) > MAX_STOP_SEQUENCES or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise InvalidRequest(f"at most {MAX_STOP_SEQUENCES} stop sequences of at most {MAX_STOP_CHARS} characters")
    if len(message.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(message.stop_token_ids)}")
    sampling = SamplingParams(
        temperature=_sampling_field(message, "temperature", checkpoint.temperature, default_temperature),
        top_p=_sampling_field(message, "top_p", checkpoint.top_p, 1.0),
        seed=message.seed if message.HasField("seed") else None,
        top_k=_sampling_field(message, "top_k", checkpoint.top_k, 0),
        logprobs=message.logprobs if message.HasField("logprobs") else None,
    )
    n = message.n if message.HasField("n") else 1
    if not 1 <= n <= min(MAX_SAMPLES, defaults.max_sessions):  # each sample is one of the concurrent generations
        raise InvalidRequest(f"n must be in [1, {min(MAX_SAMPLES, defaults.max_sessions)}], got {n}")
    return GenerationRequest(
        prompt_ids=prompt_ids,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        stop_sequences=stops,
        stop_token_ids=frozenset(message.stop_token_ids),
        draft=_draft_options(message, request_defaults(defaults, len(prompt_ids)), draft_available),
        n=n,
    )


def _max_new_tokens(
    message: gateway_pb2.GenerateRequest,
    prompt_tokens: int,
    defaults: DiffSpecSettings,
    checkpoint: SamplingDefaults,
    max_context: int,
) -> int:
    """The request's value when it sets one, else the checkpoint's generation_config.json default within the
    context the prompt leaves (at least 1: a prompt that fills the context is the engine's to refuse), else
    the server's."""
    if message.HasField("max_new_tokens"):
        return message.max_new_tokens
    if checkpoint.max_new_tokens is None:
        return defaults.max_new_tokens
    if max_context:
        return min(checkpoint.max_new_tokens, max(max_context - prompt_tokens, 1))
    return checkpoint.max_new_tokens


def _sampling_field(
    message: gateway_pb2.GenerateRequest, name: str, checkpoint: Number | None, default: Number
) -> Number:
    """The request's value when it sets one, else the checkpoint's generation_config.json default, else ours."""
    if message.HasField(name):
        return getattr(message, name)
    return default if checkpoint is None else checkpoint


def _draft_options(
    message: gateway_pb2.GenerateRequest, defaults: DraftOptions, draft_available: bool
) -> DraftOptions | None:
    """None for Auto; a tree config given with Auto is parsed here, where it would otherwise be dropped (the
    engine checks the options of every other policy). ``defaults``: the server's for this prompt's length
    (``draft_service.tuned_profile``)."""
    policy = message.policy or (defaults.policy if draft_available else "auto")
    if policy == "auto":
        if message.tree_config:
            TreeBudget.parse(message.tree_config)
        return None
    return DraftOptions(
        policy=policy,
        tree_config=message.tree_config or defaults.tree_config,
        salience=message.salience if message.HasField("salience") else defaults.salience,
    )


def chunk_to_proto(chunk: GenerationChunk) -> gateway_pb2.GenerateResponse:
    response = gateway_pb2.GenerateResponse(token_ids=chunk.token_ids, text=chunk.text, index=chunk.index)
    if chunk.logprobs is not None:
        response.logprobs.CopyFrom(logprobs_to_proto(chunk.logprobs))
    if chunk.stats is not None:
        response.stats.CopyFrom(stats_to_proto(chunk.stats))
    if chunk.prefill_progress is not None:
        done, total = chunk.prefill_progress
        response.prefill_progress.CopyFrom(gateway_pb2.PrefillProgress(done_tokens=done, total_tokens=total))
    return response


def chunk_from_proto(response: gateway_pb2.GenerateResponse) -> GenerationChunk:
    stats = stats_from_proto(response.stats) if response.HasField("stats") else None
    progress = response.prefill_progress if response.HasField("prefill_progress") else None
    return GenerationChunk(
        token_ids=list(response.token_ids),
        text=response.text,
        stats=stats,
        prefill_progress=(progress.done_tokens, progress.total_tokens) if progress is not None else None,
        logprobs=logprobs_from_proto(response.logprobs) if response.HasField("logprobs") else None,
        index=response.index,
    )


def stats_to_proto(stats: GenerationStats) -> gateway_pb2.GenerationStats:
    return gateway_pb2.GenerationStats(
        prompt_tokens=stats.prompt_tokens,
        new_tokens=stats.new_tokens,
        steps=stats.steps,
        accepted_drafts=stats.accepted_drafts,
        mean_accepted_length=stats.mean_accepted_length,
        stop_depth_histogram=stats.stop_depth_histogram,
        prefill_seconds=stats.prefill_seconds,
        draft_seconds=stats.draft_seconds,
        verify_seconds=stats.verify_seconds,
        decode_seconds=stats.decode_seconds,
        decode_tokens_per_second=stats.decode_tokens_per_second,
        finish_reason=stats.finish_reason,
        fell_back_to_auto=stats.fell_back_to_auto,
        hazard=stats.hazard,
        working_set_tokens=stats.working_set_tokens,
        working_set_updates=stats.working_set_updates,
    )


def stats_from_proto(message: gateway_pb2.GenerationStats) -> GenerationStats:
    """The engine's stats again (the derived tau and tokens/s recompute to the same values)."""
    return GenerationStats(
        prompt_tokens=message.prompt_tokens,
        new_tokens=message.new_tokens,
        steps=message.steps,
        accepted_drafts=message.accepted_drafts,
        stop_depth_histogram=list(message.stop_depth_histogram),
        prefill_seconds=message.prefill_seconds,
        draft_seconds=message.draft_seconds,
        verify_seconds=message.verify_seconds,
        decode_seconds=message.decode_seconds,
        finish_reason=message.finish_reason,
        fell_back_to_auto=message.fell_back_to_auto,
        hazard=list(message.hazard),
        working_set_tokens=message.working_set_tokens,
        working_set_updates=message.working_set_updates,
    )
