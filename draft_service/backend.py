"""The contract between the engine loop and a draft: in process or over gRPC, the same call.

One ``step`` call per loop iteration carries the whole batch: sessions to release (their
final stats come back), prompts to look up in the draft's prefix cache (before the target opens
them: it computes features only past the cached entries), sessions to start (the prompt's EAGLE-3
features from the target),
the tokens the target committed for each running session at the last verification (with
their features), and the sessions to propose a tree for. The measured cost of the last
verification batch rides along, so tree budgets follow the batch they will be verified in.

Torch-free: features are tensors in process and the received bytes when relayed by a gateway
(``diffspec/feature_rows.py``), trees a ``DraftTree`` from the in-process draft or ``TreeNodes``
from the wire (``diffspec/tree_nodes.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from diffspec.errors import DiffSpecError
from diffspec.feature_rows import Features
from diffspec.tree_nodes import ProposedTree
from draft_service.options import DraftOptions

if TYPE_CHECKING:
    from diffspec.device_accept import DeviceAccept

__all__ = [
    "DraftOptions", "DraftStats", "PrefixLookup", "DraftStart", "DraftAccept", "VerifyCost", "DraftBatch",
    "DraftBatchResult",
]  # fmt: skip


@dataclass(frozen=True)
class DraftStats:
    """What the draft reports about a session at its end (hazard, working set)."""

    hazard: list[float] = field(default_factory=list)  # h(d) per depth, as last estimated
    working_set_tokens: int = 0  # tokens the draft attended to at the last step
    context_tokens: int = 0  # tokens in the draft's full context
    working_set_updates: int = 0  # times the working set changed, each an update of the chunk arenas


@dataclass(frozen=True)
class PrefixLookup:
    """A queued prompt's leading entries the draft's prefix cache holds, pinned for its session until it starts or
    is released (``draft_service/prefix_cache.py``)."""

    session_id: str
    prompt_ids: list[int]
    cache_scope: str = ""  # tenant: cached entries are shared only within a scope


@dataclass(frozen=True)
class DraftStart:
    session_id: str
    prompt_ids: list[int]
    features: Features  # [len(prompt_ids) - cached_positions, 3 * target_hidden]: the positions after the cached
    first_token: int
    options: DraftOptions
    cached_positions: int = 0  # leading prompt entries taken from the session's prefix-cache lookup


@dataclass(frozen=True)
class DraftAccept:
    session_id: str
    emitted_tokens: list[int]  # accepted drafts then the bonus token
    features: Features  # [len(emitted_tokens), 3 * target_hidden]: root + accepted positions
    # the tokens verify the draft's last tree for this session; False after an Auto step taken in its stead
    # (its proposal late, or too deep for the context left): the hazard profile then learns nothing
    verified_draft_tree: bool = True


@dataclass(frozen=True)
class VerifyCost:
    """One measured verification batch: what the tree-budget planner learns the verify cost from."""

    rows: int  # sessions verified x the widest tree's tokens: the padded rows the verify computed
    seconds: float  # wall time of the target step that verified them


@dataclass(frozen=True)
class DraftBatch:
    releases: list[str] = field(default_factory=list)  # a session's or a lookup's pin
    starts: list[DraftStart] = field(default_factory=list)
    accepts: list[DraftAccept] = field(default_factory=list)
    proposes: list[str] = field(default_factory=list)  # after starts and accepts are applied
    verify_cost: VerifyCost | None = None
    lookups: list[PrefixLookup] = field(default_factory=list)  # applied after the releases, before the starts

    def __bool__(self) -> bool:
        return bool(self.releases or self.lookups or self.starts or self.accepts or self.proposes)


@dataclass(frozen=True)
class DraftBatchResult:
    trees: dict[str, ProposedTree] = field(default_factory=dict)
    released: dict[str, DraftStats] = field(default_factory=dict)
    failures: dict[str, DiffSpecError] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)  # per lookup: leading prompt entries pinned for it


class DraftBackend(Protocol):
    def step(self, batch: DraftBatch) -> DraftBatchResult: ...


@runtime_checkable
class AcceptsOnDevice(Protocol):
    """A draft in the target's process: it writes a verify's accepted entries from the device's acceptance
    while that verify runs (``DraftRuntime.accept_on_device``), and may queue the next proposal behind them; the
    next step's accepts settle them. ``ending``: sessions this verify surely ends (it emits their last token):
    nothing is written or proposed for them."""

    def accept_on_device(self, accepts: dict[str, DeviceAccept], ending: frozenset[str] = frozenset()) -> set[str]: ...
