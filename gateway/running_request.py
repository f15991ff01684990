"""One request inside the engine loop: where it stands, what it owes each service, what it has emitted.

Phases: ``WAITING`` (admitted, no target session yet) -> ``PREFILLING`` (prompt chunks) ->
``DECODING`` (a tree or an Auto step every iteration) -> ``FINISHED``. A finished request still
owes releases to the services that hold its sessions; its last chunk (with the stats) goes out
once the draft has reported its final hazard and working set.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

from diffspec.feature_rows import Features, concat_rows
from diffspec.sampling_params import TokenLogprobs
from diffspec.tree_nodes import ProposedTree, TreeNodes
from draft_service.backend import DraftAccept, DraftStart, DraftStats
from gateway.detokenizer import IncrementalDetokenizer, Tokenizer
from gateway.request import GenerationChunk, GenerationRequest, GenerationStats
from target_service.backend import PrefillResult, SessionOpen, TargetInfo, VerifyResult


class OutputSink(Protocol):
    """Where a request's chunks go; called from the engine thread."""

    def put(self, chunk: GenerationChunk) -> None: ...

    def fail(self, error: BaseException) -> None: ...


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


@dataclass
class RunningRequest:
    request_id: str
    request: GenerationRequest
    sink: OutputSink
    info: TargetInfo
    detokenizer: IncrementalDetokenizer
    deadline: float | None  # time.monotonic() by which the request must end
    phase: Phase = Phase.WAITING
    stats: GenerationStats = field(default_factory=GenerationStats)
    drafting: bool = False  # proposals come from the draft; False = Auto (from the start or after a fallback)
    draft_session: bool = False  # the draft holds a session for it
    draft_pin: bool = False  # the draft holds its prompt's cached entries, pinned by a lookup, until the start
    draft_cached: int | None = None  # leading prompt entries the draft's prefix cache holds (None: not looked up)
    target_session: bool = False  # the target holds a session for it
    forked: bool = False  # its target session forks the prompt pages of another sample of its request
    inherited_features: Features | None = None  # [prompt, 3 * hidden] the forked sample's, until the first prefill
    last_token: int = -1  # last emitted token: the next tree's root
    prefilled_tokens: int = 0  # prompt tokens the target has reported done
    prompt_features: list[Features] = field(default_factory=list)  # per prefill chunk, until the draft starts
    pending_start: DraftStart | None = None
    pending_accept: DraftAccept | None = None
    tree: ProposedTree | None = None  # this iteration's proposal
    verifying_draft_tree: bool = False  # the tree in verification is the draft's proposal, not an Auto step
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float = 0.0

    @staticmethod
    def create(
        request_id: str,
        request: GenerationRequest,
        sink: OutputSink,
        info: TargetInfo,
        tokenizer: Tokenizer,
        deadline: float | None,
    ) -> RunningRequest:
        return RunningRequest(
            request_id=request_id,
            request=request,
            sink=sink,
            info=info,
            detokenizer=IncrementalDetokenizer(tokenizer, request.stop_sequences),
            deadline=deadline,
            stats=GenerationStats(prompt_tokens=len(request.prompt_ids)),
            drafting=request.draft is not None,
        )

    @property
    def finished(self) -> bool:
        return bool(self.stats.finish_reason)

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def awaiting_first_token(self) -> bool:
        """The whole prompt went to the target, which reports its first token in a later step."""
        return self.phase is Phase.PREFILLING and self.prefilled_tokens == self.prompt_tokens

    @property
    def prompt_tokens_to_compute(self) -> int:
        """Prompt positions whose forward the target has still to run: what a prefill charges the iteration's
        token budget. A fork shares its parent's pages of every prompt position but the last, whose forward
        samples its own first token, so it computes one position, not its whole prompt; should its parent
        have been released before it opened, the target prefills it from that first position on, reporting
        its progress, and later chunks are charged from there."""
        if self.forked and self.prefilled_tokens == 0:
            return 1
        return self.prompt_tokens - self.prefilled_tokens

    @property
    def waits_for_prompt(self) -> bool:
        """A sample of an n > 1 request that stays unopened while another sample prefills their prompt."""
        share = self.request.prompt_share
        if share is None or share.source is None or share.source is self:
            return False
        return share.source.phase in (Phase.WAITING, Phase.PREFILLING)

    @property
    def needs_lookup(self) -> bool:
        """A queued drafting request whose prompt the draft's prefix cache has not been asked about: it opens on the
        target after the answer (the samples of an n > 1 request share their prompt by fork instead)."""
        return (
            self.phase is Phase.WAITING and self.drafting and self.draft_cached is None
            and self.request.prompt_share is None
        )  # fmt: skip

    @property
    def can_fork(self) -> bool:
        """A sample of its request has prefilled the prompt and kept the prompt features this one's draft
        would start on, if it drafts: its session opens as a fork of that one's."""
        share = self.request.prompt_share
        return share is not None and bool(share.session_id) and (share.features is not None or not self.drafting)

    def session_open(self, feature_layers: tuple[int, ...]) -> SessionOpen:
        """The target session to open: a fork of the prompt of an earlier sample of the same request once
        one is prefilled (its pages, and its features for the draft), else one that computes the prompt."""
        share, request = self.request.prompt_share, self.request
        if share is not None and share.source is None:
            share.source = self
        elif share is not None and self.can_fork:
            self.forked, self.inherited_features = True, share.features if self.drafting else None
            share.forks_left -= 1
            if share.forks_left <= 0:
                share.features = None
        fork_of = share.session_id if self.forked and share is not None else ""
        features_from = (self.draft_cached or 0) if self.drafting else 0
        return SessionOpen(self.request_id, request.prompt_ids, request.sampling, self.drafting, request.client,
                           feature_layers, fork_of, features_from)  # fmt: skip

    def on_prefill(self, result: PrefillResult) -> None:
        """Stream the progress; once the prompt is done, emit the first token and queue the draft's start."""
        self.prefilled_tokens = result.done_tokens
        if result.features is not None and self.drafting:
            if self.inherited_features is not None:  # the rows before the first computed one are the fork's
                start = result.done_tokens - len(result.features)
                if start:  # a recomputed prompt (the fork's parent was gone) needs none of them
                    self.prompt_features.append(self.inherited_features[:start])
                self.inherited_features = None
            # rows of positions the draft's prefix cache holds: the target computed them for its own pages
            first = result.done_tokens - len(result.features)
            cached = min(len(result.features), max(0, (self.draft_cached or 0) - first))
            if cached < len(result.features):
                self.prompt_features.append(result.features[cached:])
        if result.first_token is None:
            if result.done_tokens < result.total_tokens:  # a finished prompt's first token says so itself
                self.sink.put(GenerationChunk([], "", prefill_progress=(result.done_tokens, result.total_tokens)))
            return
        self.first_token_at = time.perf_counter()
        self.stats.prefill_seconds = self.first_token_at - self.submitted_at
        self.phase = Phase.DECODING
        self._emit([result.first_token], result.first_logprobs)
        features = concat_rows(self.prompt_features) if self.drafting else None
        if features is not None and not self.finished and self.tokens_left > 1:  # one left: an Auto step emits it
            assert self.request.draft is not None
            self.pending_start = DraftStart(
                self.request_id, self.request.prompt_ids, features, result.first_token, self.request.draft,
                self.draft_cached or 0,
            )
        share = self.request.prompt_share
        if share is not None and not self.forked and share.forks_left > 0:
            share.session_id, share.features = self.request_id, features
        self.prompt_features = []

    def on_verify(self, result: VerifyResult) -> None:
        self.stats.record_step(len(result.accepted_tokens))
        self._emit(result.emitted_tokens, result.logprobs)
        if self.drafting and self.draft_session and not self.finished:
            assert result.features is not None
            self.pending_accept = DraftAccept(
                self.request_id, result.emitted_tokens, result.features, self.verifying_draft_tree
            )

    def fall_back_to_auto(self) -> None:
        """The draft is gone for this request; the target alone goes on (the tokens do not change)."""
        self.drafting = False
        self.stats.fell_back_to_auto = True
        self.pending_start = self.pending_accept = self.tree = None
        self.prompt_features, self.inherited_features = [], None

    @property
    def tokens_left(self) -> int:
        """Tokens it may still emit before ``max_new_tokens`` or the context's end."""
        context_left = self.info.max_context - self.prompt_tokens - self.stats.new_tokens
        return min(self.request.max_new_tokens - self.stats.new_tokens, context_left)

    @property
    def wants_proposal(self) -> bool:
        """A drafting request whose next verify may emit more than one token: with one left, an Auto step
        emits it, and a tree would be drafted and verified in vain."""
        return self.drafting and self.draft_session and self.tokens_left > 1

    def next_tree(self) -> ProposedTree:
        """This iteration's proposal if it fits the context left, else one Auto step."""
        tree, self.tree = self.tree, None
        context_left = self.info.max_context - self.prompt_tokens - self.stats.new_tokens
        self.verifying_draft_tree = tree is not None and tree.max_depth + 1 < context_left
        if self.verifying_draft_tree:
            assert tree is not None
            return tree
        return TreeNodes.root_only(self.last_token)

    def finish(self, draft_stats: DraftStats | None) -> None:
        """The last chunk: held-back text and the stats."""
        self.stats.decode_seconds = time.perf_counter() - self.first_token_at if self.first_token_at else 0.0
        if draft_stats is not None:
            self.stats.hazard = draft_stats.hazard
            self.stats.working_set_tokens = draft_stats.working_set_tokens
            self.stats.working_set_updates = draft_stats.working_set_updates
        self.sink.put(GenerationChunk(token_ids=[], text=self.detokenizer.flush(), stats=self.stats))

    def _emit(self, tokens: list[int], logprobs: TokenLogprobs | None) -> None:
        """Clip the step's tokens (and their logprobs) at EOS, a stop token or sequence, max_new_tokens or the
        context end, and send them. EOS and stop tokens end the request without being emitted, wherever
        they fall in an accepted run, so speculation stops where Auto would."""
        kept: list[int] = []
        text = ""
        for token in tokens:
            if token in self.info.eos_token_ids:
                self.stats.finish_reason = "eos"
                break
            if token in self.request.stop_token_ids:
                self.stats.finish_reason = "stop"
                break
            kept.append(token)
            self.last_token = token
            self.stats.new_tokens += 1
            text += self.detokenizer.push(token)
            if self.detokenizer.stopped:
                self.stats.finish_reason = "stop"
            elif self.stats.new_tokens >= self.request.max_new_tokens:
                self.stats.finish_reason = "length"
            elif self.prompt_tokens + self.stats.new_tokens >= self.info.max_context:
                self.stats.finish_reason = "context"
            if self.stats.finish_reason:
                break
        if kept or text:
            kept_logprobs = logprobs.head(len(kept)) if logprobs is not None else None
            self.sink.put(GenerationChunk(token_ids=kept, text=text, logprobs=kept_logprobs))
