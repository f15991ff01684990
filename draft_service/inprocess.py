"""Load the draft runtime from settings: the head, its working-set rules, and the target's embedding.

The draft runtime is itself the in-process ``DraftBackend``; the engine loop calls its ``step``. A head
trained on other target layers than the target's default needs nothing of the target: the engine asks
the target for those layers' features in each speculative session (``SessionOpen.feature_layers``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from diffspec.devices import resolve_device, resolve_dtype
from diffspec.errors import InvalidRequest
from diffspec.model_config import load_llama_config
from diffspec.settings import DiffSpecSettings, parse_sizes
from draft_service.eagle3_head import Eagle3Head
from draft_service.head_fit import check_head_fits_target, feature_layers_for, read_head_config
from draft_service.runtime import DraftRuntime
from draft_service.target_embedding import load_target_embedding
from draft_service.working_set import WorkingSetConfig

if TYPE_CHECKING:
    from target_service.runtime import TargetRuntime


def working_set_config(settings: DiffSpecSettings) -> WorkingSetConfig:
    """The settings' working set, checked at start: one too small for its own sink and recent chunks is refused
    here rather than in a request."""
    try:
        return WorkingSetConfig.of_tokens(
            settings.chunk_size,
            settings.working_set_tokens,
            settings.salience_recent_tokens,
            reselect_every=settings.salience_reselect_every,
            min_overlap=settings.salience_min_overlap,
            compact_positions=settings.salience_compact_positions,
        ).fitting()
    except ValueError as bad:
        raise InvalidRequest(f"working_set_tokens {settings.working_set_tokens} with chunk_size {settings.chunk_size} "
                             f"and salience_recent_tokens {settings.salience_recent_tokens}: {bad}") from None


def load_draft_runtime(settings: DiffSpecSettings, target: TargetRuntime | None = None) -> DraftRuntime:
    """Load the head; the target's embedding is shared when the target runs in this process."""
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    target_config = target.model.config if target is not None else load_llama_config(settings.base_model)
    head_config = read_head_config(settings.draft_model)
    check_head_fits_target(head_config, target_config, settings.draft_model, settings.base_model)  # before weights
    feature_layers_for(settings, target_config, head_config)  # an explicit DIFFSPEC_FEATURE_LAYERS must agree
    embedding = target.model.embed_tokens if target is not None else None
    if embedding is None:
        embedding = load_target_embedding(settings.base_model, device, dtype)
    head = Eagle3Head.load(settings.draft_model, embedding, device, dtype)
    batches = parse_sizes(settings.graph_batch_sizes)  # the batches the target records graphs for
    return DraftRuntime(
        head, working_set_config(settings), settings.cuda_graphs, batches, settings.draft_quantization,
        propose_ahead=settings.propose_ahead, prefix_cache_tokens=settings.draft_prefix_cache_capacity,
    )  # fmt: skip
