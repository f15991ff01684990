"""Which EAGLE-3 head drafts for which target, decided from config.json files before any weight
is read (so before a server says it is listening).

- No draft configured and a target other than the bundled one: serve Auto, in one log line (vLLM
  without a speculative config). The bundled demo head was trained for ``models/tiny-code`` only.
- A head that does not fit its target (vocabulary, feature width, feature layers): a
  ``CheckpointError`` that names both directories and the mismatch.
- The target extracts the features the head was trained on: the head's
  ``eagle_aux_hidden_state_layer_ids`` when it declares them, as vLLM applies them.
"""

from __future__ import annotations

import logging
from pathlib import Path

from diffspec.errors import CheckpointError
from diffspec.model_config import LlamaConfig, read_config
from diffspec.settings import BUNDLED_TARGET, DiffSpecSettings, resolve_feature_layers
from draft_service.eagle3_config import Eagle3Config

log = logging.getLogger(__name__)


def draft_model_for(settings: DiffSpecSettings) -> Path | None:
    """The head directory to load, or None to serve Auto only."""
    if "draft_model" in settings.model_fields_set:
        return settings.draft_model  # configured: one that is missing or does not fit is an error
    if Path(settings.base_model).resolve() != BUNDLED_TARGET.resolve():
        log.warning(
            "no draft model configured for %s (the bundled demo head drafts for %s only): serving Auto; "
            "set DIFFSPEC_DRAFT_MODEL to an EAGLE-3 head trained for this target to speculate",
            settings.base_model, BUNDLED_TARGET.name,
        )  # fmt: skip
        return None
    return settings.draft_model


def read_head_config(head_dir: Path) -> Eagle3Config:
    return Eagle3Config.from_json(read_config(head_dir))


def check_head_fits_target(head: Eagle3Config, target: LlamaConfig, head_dir: Path, target_dir: Path) -> None:
    """Raise a ``CheckpointError`` naming every way the head does not fit the target."""
    problems = []
    if head.vocab_size != target.vocab_size:
        problems.append(f"its vocabulary has {head.vocab_size} tokens, the target's {target.vocab_size}")
    if head.target_hidden_size != target.hidden_size:
        problems.append(f"it reads features {head.target_hidden_size} wide, the target's are {target.hidden_size}")
    outside = [i for i in head.feature_layers if not 0 <= i < target.num_layers]
    if outside:
        problems.append(f"it was trained on target layers {list(head.feature_layers)}, "
                        f"the target has layers 0..{target.num_layers - 1}")  # fmt: skip
    if problems:
        raise CheckpointError(
            f"draft head {head_dir} does not fit target {target_dir}: {'; '.join(problems)}. "
            "Set DIFFSPEC_DRAFT_MODEL to an EAGLE-3 head trained for this target."
        )


def feature_layers_for(settings: DiffSpecSettings, target: LlamaConfig, head: Eagle3Config | None) -> tuple[int, ...]:
    """The target layers whose residual-stream inputs feed the draft: the head's declared layers,
    else DIFFSPEC_FEATURE_LAYERS (``auto``: 2, L//2, L-3). An explicit setting that contradicts the
    head would feed it features it was not trained on, so that is an error."""
    configured = resolve_feature_layers(settings.feature_layers, target.num_layers)
    if head is None or not head.feature_layers:
        return configured
    if settings.feature_layers != "auto" and configured != head.feature_layers:
        raise CheckpointError(
            f"DIFFSPEC_FEATURE_LAYERS={settings.feature_layers} contradicts the draft head, "
            f"which was trained on target layers {list(head.feature_layers)}; leave it at auto"
        )
    return head.feature_layers
