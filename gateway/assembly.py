"""Wire an engine from settings: in-process backends by default, gRPC clients when addresses are set."""

from __future__ import annotations

import logging

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from diffspec.errors import CheckpointError
from diffspec.settings import DiffSpecSettings
from draft_service.backend import DraftBackend
from gateway.engine import SpeculativeEngine
from target_service.backend import TargetBackend

log = logging.getLogger(__name__)


def load_tokenizer(settings: DiffSpecSettings) -> PreTrainedTokenizerBase:
    """The target's tokenizer, read from the target checkpoint directory."""
    try:
        return AutoTokenizer.from_pretrained(str(settings.base_model))
    except (OSError, ValueError) as bad:
        raise CheckpointError(f"cannot load a tokenizer from {settings.base_model}: {bad}") from None


def build_target(settings: DiffSpecSettings) -> TargetBackend:
    from target_service.inprocess import InProcessTarget
    from target_service.runtime import TargetRuntime

    return InProcessTarget(TargetRuntime(settings), settings.max_batch_tokens)


def build_draft(settings: DiffSpecSettings, target: TargetBackend) -> DraftBackend | None:
    """The in-process draft, or None (Auto only) when the draft model directory is absent."""
    if not settings.draft_model.exists():
        log.warning("no draft model at %s: only policy 'auto' is served", settings.draft_model)
        return None
    from draft_service.inprocess import InProcessDraft

    return InProcessDraft.from_settings(settings, target)


def build_engine(settings: DiffSpecSettings, with_draft: bool = True) -> SpeculativeEngine:
    target = build_target(settings)
    draft = build_draft(settings, target) if with_draft else None
    return SpeculativeEngine(target, draft, load_tokenizer(settings))
