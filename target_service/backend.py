"""The contract between the engine loop and a target: in process or over gRPC, the same call.

The engine makes one ``step`` call per loop iteration with the whole batch's work: sessions to
release, sessions to open (the prompt, its sampling), the next prompt chunk of each prefilling
session, and one tree per decoding session (a root-only tree is an Auto step). A session's
failure (bad input, no pages left, a sampling overflow) comes back in ``failures`` and leaves
every other session of the batch untouched. Each result reports the KV pages left free, so the
engine admits new sessions against the target's real capacity, in process and over gRPC alike.

Torch-free: a tree is any ``ProposedTree`` (a ``DraftTree`` from the in-process draft, ``TreeNodes``
from the wire or for an Auto step), and features are tensors in process, the received bytes when
relayed by a gateway (``diffspec/feature_rows.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from diffspec.errors import DiffSpecError
from diffspec.feature_rows import Features
from diffspec.sampling_params import SamplingParams, TokenLogprobs
from diffspec.tree_nodes import ProposedTree

if TYPE_CHECKING:
    from diffspec.device_accept import VerifyQueued


@dataclass(frozen=True)
class SessionOpen:
    session_id: str
    prompt_ids: list[int]  # target-vocab ids of the whole prompt
    sampling: SamplingParams
    want_features: bool  # send EAGLE-3 features of every prompt position and of every accepted token
    cache_scope: str = ""  # tenant: prompt pages are shared only with sessions of the same scope
    feature_layers: tuple[int, ...] = ()  # target layers the features come from; () = the target's default
    # a decoding session of the same prompt whose pages of every prompt position but the last are shared, and
    # whose features of those positions the gateway holds: they are not computed again; "" = none
    fork_of: str = ""
    # with want_features: features only from this prompt position on (the draft's prefix cache holds the entries
    # before it), so the prefix cache's pages before it need no forward; in [0, len(prompt_ids))
    features_from: int = 0


@dataclass(frozen=True)
class PrefillWork:
    session_id: str
    num_tokens: int  # prompt tokens to compute in this step (the session's next chunk)


@dataclass(frozen=True)
class VerifyStep:
    session_id: str
    tree: ProposedTree  # rooted at the session's last emitted token; root-only = one Auto step


@dataclass(frozen=True)
class TargetBatch:
    releases: list[str] = field(default_factory=list)  # sessions to free first
    opens: list[SessionOpen] = field(default_factory=list)
    prefills: list[PrefillWork] = field(default_factory=list)
    verifies: list[VerifyStep] = field(default_factory=list)
    # a prompt finished in this step is reported, with its first token, by a later step that collects it:
    # its forward then runs behind the caller's next host work instead of being waited for
    first_tokens_next_step: bool = False
    collects: list[str] = field(default_factory=list)  # sessions whose deferred finished prompt to report
    # in process: handed the greedy sessions' device acceptances before the host waits for the verify, so a
    # draft can commit them while the forward runs; a target over the wire never calls it
    on_verify_queued: VerifyQueued | None = None
    # in process: called once the verify's device work is queued, before the host waits for its results (the
    # engine hands clients their chunks then, so the threads that stream them run while this one waits)
    before_results_wait: Callable[[], None] | None = None

    @property
    def padded_rows(self) -> int:
        """Rows the verify forward computes: every tree is padded to the widest."""
        return len(self.verifies) * max((step.tree.num_nodes for step in self.verifies), default=0)

    def __bool__(self) -> bool:
        return bool(self.releases or self.opens or self.prefills or self.verifies or self.collects)


@dataclass(frozen=True)
class PrefillResult:
    done_tokens: int  # prompt tokens whose KV is in the pages after this step
    total_tokens: int  # prompt length
    # sampled from the last prompt position; set once the prompt is done (with ``first_tokens_next_step``,
    # by the step that collects it, which also carries the last chunk's features)
    first_token: int | None
    features: Features | None  # [rows computed, 3 * hidden], only when features were asked for
    first_logprobs: TokenLogprobs | None = None  # of first_token, when the sampling asks for logprobs


@dataclass(frozen=True)
class VerifyResult:
    accepted_tokens: list[int]  # draft tokens accepted, in order (root and bonus excluded)
    accepted_nodes: list[int]  # their tree node indices
    bonus_token: int  # the target's token after the accepted path; the next tree's root
    features: Features | None  # [1 + len(accepted), 3 * hidden] at the root and accepted positions
    logprobs: TokenLogprobs | None = None  # of emitted_tokens, when the sampling asks for logprobs

    @property
    def emitted_tokens(self) -> list[int]:
        """What the client receives from this step: accepted drafts, then the bonus."""
        return [*self.accepted_tokens, self.bonus_token]


@dataclass(frozen=True)
class TargetBatchResult:
    prefills: dict[str, PrefillResult] = field(default_factory=dict)
    verifies: dict[str, VerifyResult] = field(default_factory=dict)
    failures: dict[str, DiffSpecError] = field(default_factory=dict)  # session -> why its work was dropped
    num_free_pages: int | None = None  # KV pages free after the step (what admission counts on); None = unknown
    # the verify's device span, from its start on the device (behind a pending proposal) to its last kernel;
    # None where it is not measured (over the wire): the caller's wall time of the step stands in
    verify_seconds: float | None = None
    # rows the verify forward computed: a step graph's whole bucket (batch bucket x tree bucket), else every
    # tree's nodes; None where it is not known (over the wire): the batch's requested rows stand in
    verify_rows: int | None = None


@dataclass(frozen=True)
class TargetInfo:
    model: str  # checkpoint path or name
    vocab_size: int
    hidden_size: int
    num_layers: int
    feature_layers: tuple[int, ...]
    eos_token_ids: tuple[int, ...]
    max_context: int  # tokens (prompt + generated)
    page_size: int
    num_pages: int
    num_free_pages: int
    active_sessions: int
    device: str
    dtype: str


class TargetBackend(Protocol):
    def step(self, batch: TargetBatch) -> TargetBatchResult: ...

    def info(self) -> TargetInfo: ...
