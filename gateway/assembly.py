"""Wire the engine from settings: the models in process by default, gRPC clients when addresses are set."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from diffspec.errors import CheckpointError, PeerUnavailable
from diffspec.model_config import load_generation_config
from diffspec.sampling_params import SamplingDefaults
from diffspec.settings import BUNDLED_TARGET, DiffSpecSettings
from draft_service.backend import DraftBackend
from gateway.engine import SpeculativeEngine
from gateway.engine_core import EngineLimits
from gateway.quota import QuotaLimits
from target_service.backend import TargetBackend

log = logging.getLogger(__name__)

PEER_POLL_TIMEOUT_S = 5.0  # one readiness poll of a remote target (a blackholed host never answers)


def load_tokenizer(settings: DiffSpecSettings) -> PreTrainedTokenizerBase:
    """The target's tokenizer, read from the target checkpoint directory."""
    try:
        return AutoTokenizer.from_pretrained(str(settings.base_model))
    except (OSError, ValueError) as bad:
        raise CheckpointError(f"cannot load a tokenizer from {settings.base_model}: {bad}") from None


def sampling_defaults(settings: DiffSpecSettings) -> SamplingDefaults:
    """The target checkpoint's generation_config.json sampling defaults with ``generation_config`` auto (said
    in one log line when there are any, as vLLM does), else none."""
    if settings.generation_config == "none":
        return SamplingDefaults()
    defaults = SamplingDefaults.of(load_generation_config(settings.base_model))
    if defaults != SamplingDefaults():
        given = ", ".join(f"{name}={value}" for name, value in vars(defaults).items() if value is not None)
        log.warning(
            "requests that leave them unset take %s from %s/generation_config.json "
            "(--generation-config none: DiffSpec's defaults)", given, settings.base_model,
        )  # fmt: skip
    return defaults


def engine_limits(settings: DiffSpecSettings) -> EngineLimits:
    return EngineLimits(
        max_requests=settings.max_sessions,
        max_batch_tokens=settings.max_batch_tokens,
        prefill_chunk=settings.prefill_chunk,
        quota=QuotaLimits(settings.client_max_requests, settings.client_max_tokens),
        accept_on_device=settings.accept_on_device,
    )


def build_target(settings: DiffSpecSettings) -> TargetBackend:
    """A gRPC client when ``target_address`` is set (not yet known to answer), else the model in process."""
    if settings.target_address:
        from target_service.grpc_client import RemoteTarget

        return RemoteTarget.connect(settings.target_address, settings)
    from target_service.runtime import TargetRuntime

    return TargetRuntime(_with_head_layers(settings))


def _with_head_layers(settings: DiffSpecSettings) -> DiffSpecSettings:
    """In one process the target's own feature layers are the head's aux layer ids (read from its
    config.json), so the CUDA graphs of its verify steps compute what every speculative session asks
    for. A split target keeps its own, and runs a step that needs other layers eagerly."""
    from diffspec.model_config import load_llama_config
    from draft_service.head_fit import read_head_config

    bundled = Path(settings.base_model).resolve() == BUNDLED_TARGET.resolve()
    configured = "draft_model" in settings.model_fields_set or bundled  # else Auto (draft_model_for)
    if settings.draft_address or settings.feature_layers != "auto" or not configured:
        return settings
    if not (Path(settings.draft_model) / "config.json").exists():
        return settings  # build_draft says what is missing
    layers = read_head_config(settings.draft_model).feature_layers
    num_layers = load_llama_config(settings.base_model).num_layers
    if not layers or not all(0 <= i < num_layers for i in layers):
        return settings  # the target's default, or a head that does not fit, which build_draft refuses
    return settings.model_copy(update={"feature_layers": ",".join(str(i) for i in layers)})


def build_draft(settings: DiffSpecSettings, target: TargetBackend) -> DraftBackend | None:
    """A gRPC client when ``draft_address`` is set, else the in-process draft, or None (Auto only)
    when no head is configured for this target or the head directory is absent."""
    if settings.draft_address:
        from draft_service.grpc_client import RemoteDraft

        return RemoteDraft.connect(settings.draft_address, settings)
    from draft_service.head_fit import draft_model_for

    head_dir = draft_model_for(settings)
    if head_dir is None:
        return None
    if not head_dir.exists():
        log.warning("no draft model at %s: only policy 'auto' is served", head_dir)
        return None
    from draft_service.inprocess import load_draft_runtime
    from target_service.runtime import TargetRuntime

    return load_draft_runtime(settings, target if isinstance(target, TargetRuntime) else None)


def build_engine(settings: DiffSpecSettings, with_draft: bool = True) -> SpeculativeEngine:
    """The whole gateway: backends, tokenizer and the engine loop (blocking: models load, a remote target
    is waited for, here)."""
    target = build_target(settings)
    if settings.target_address:
        asyncio.run(wait_for_target(target, settings.peer_wait_seconds))
    return _assemble(settings, target, with_draft)


async def load_engine(settings: DiffSpecSettings) -> SpeculativeEngine:
    """``build_engine`` for a server's event loop: the wait for a remote target can be cancelled (a SIGTERM
    while the target is still down ends the process at once), and models load in a worker thread."""
    target = build_target(settings)
    if settings.target_address:
        await wait_for_target(target, settings.peer_wait_seconds)
    return await asyncio.to_thread(_assemble, settings, target, True)


def _assemble(settings: DiffSpecSettings, target: TargetBackend, with_draft: bool) -> SpeculativeEngine:
    draft = build_draft(settings, target) if with_draft else None
    layers = head_feature_layers(draft, PEER_POLL_TIMEOUT_S)
    return SpeculativeEngine(
        target, draft, load_tokenizer(settings), engine_limits(settings), layers, sampling_defaults(settings)
    )


def head_feature_layers(draft: DraftBackend | None, timeout: float) -> tuple[int, ...]:
    """The target layers the draft's head reads (its aux layer ids), which the target extracts for every
    speculative session: from the head's config in process, from the draft service's Info when split.
    () = the target's default; also when a remote draft does not answer within ``timeout``, in one log line."""
    head = getattr(draft, "head", None)  # the in-process DraftRuntime
    if head is not None:
        return tuple(head.config.feature_layers)
    from draft_service.grpc_client import RemoteDraft

    if not isinstance(draft, RemoteDraft):
        return ()
    try:
        return draft.feature_layers(timeout)
    except PeerUnavailable as gone:
        log.warning("the draft did not say which target layers its head reads (%s): using the target's default", gone)
        return ()


async def wait_for_target(target, timeout: float) -> None:  # noqa: ANN001 - a RemoteTarget
    """Poll ``info`` until the target answers (it is UNAVAILABLE while it loads), at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        try:
            await asyncio.to_thread(target.info, PEER_POLL_TIMEOUT_S)
            return
        except PeerUnavailable as failure:
            if time.monotonic() + delay > deadline:
                raise PeerUnavailable(f"the target did not answer within {timeout:.0f} s: {failure}") from None
        await asyncio.sleep(delay)
        delay = min(2 * delay, 1.0)
