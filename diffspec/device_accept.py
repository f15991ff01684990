"""A verify's acceptance of one session as the device computed it, handed from target to draft in one process.

Why: a draft in the same process commits the accepted entries while the verify still runs, instead of
after the host has read its results (``target_service/device_acceptance.py`` computes it,
``Drafter.extend_on_device`` commits it, the host's own acceptance settles it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at run time: a split gateway imports the engine loop, which names this type
    import torch


@dataclass(frozen=True)
class DeviceAccept:
    """Rows padded to ``max_entries`` (the tree's depth bound + 1) by repeating the last emitted one; the host's
    acceptance, read after the forward, decides which are kept."""

    features: torch.Tensor  # [max_entries, len(layers) * hidden] at the root and each accepted node
    next_tokens: torch.Tensor  # [max_entries] int64: the emitted tokens (accepted drafts, then the bonus)
    num_entries: torch.Tensor  # [] int64: how many rows are real (1 + accepted drafts)
    max_entries: int
    rows: torch.Tensor | None = None  # [max_entries] int64: the forward's row of each entry, for the target's commit


# session -> its device acceptance; an in-process target calls it once the verify is queued
VerifyQueued = Callable[[dict[str, DeviceAccept]], None]
