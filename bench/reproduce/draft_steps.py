"""What each drafting step proposed and what the target kept of it, recorded between the engine loop
and its draft (the services are untouched), so the hazard estimates can be replayed step by step.

The recorder is a ``DraftBackend`` around the real one: it notes the tree proposed for a session and,
when that session's next accept arrives, pairs the tree with the tokens the target emitted. Only
references are kept during a run (a dict operation per session and step); the per-step figures are
worked out afterwards, in ``take``, outside the timed region.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Protocol, runtime_checkable

from diffspec.device_accept import DeviceAccept
from diffspec.settings import DiffSpecSettings
from diffspec.tree import DraftTree
from diffspec.tree_nodes import ProposedTree
from draft_service.backend import AcceptsOnDevice, DraftBackend, DraftBatch, DraftBatchResult
from gateway.assembly import build_draft, build_target, engine_limits, load_tokenizer
from gateway.detokenizer import Tokenizer
from gateway.engine import SpeculativeEngine
from gateway.engine_core import EngineLimits
from target_service.backend import TargetBackend


@dataclass(frozen=True)
class DraftStep:
    """One verification step of a drafting request, as the draft's hazard profile observes it."""

    accepted: int  # draft tokens the target accepted (the stop depth); the bonus token is not counted
    tree_depth: int  # deepest draft depth of the proposed tree; accepted == tree_depth: censored there
    tree_tokens: int  # nodes of the proposed tree, root included
    passed_ranks: list[int]  # [accepted] sibling rank of the accepted child at depth 1, 2, ...
    stop_width: int  # children of the node where the path stopped (0: it reached a leaf)

    def to_list(self) -> list:
        """Compact form for results.json: [accepted, tree_depth, tree_tokens, passed_ranks, stop_width]."""
        return list(asdict(self).values())

    @staticmethod
    def from_list(row: list) -> DraftStep:
        return DraftStep(*row)


def observe(proposed: ProposedTree, emitted_tokens: list[int]) -> DraftStep:
    """The step's figures from its tree and the tokens the target emitted (accepted drafts, then the
    bonus). The ranks are matched exactly as ``DraftRuntime`` feeds its hazard profile."""
    tree = DraftTree.of(proposed)
    children, tokens = tree.children(), tree.tokens.tolist()
    node, ranks = 0, []
    for token in emitted_tokens[:-1]:
        match = [rank for rank, child in enumerate(children[node]) if tokens[child] == token]
        if not match:
            break
        ranks.append(match[0])
        node = children[node][match[0]]
    return DraftStep(len(emitted_tokens) - 1, tree.max_depth, tree.num_nodes, ranks, len(children[node]))


@runtime_checkable
class RecordsDraftSteps(Protocol):
    def take_draft_steps(self) -> list[DraftStep]:
        """The drafting steps verified since the last call."""
        ...


def take_draft_steps(engine: object) -> list[DraftStep]:
    """What ``engine`` recorded since the last call; nothing from an engine without a recorder
    (``gateway.assembly.build_engine``'s, as ``bench.paired`` uses)."""
    return engine.take_draft_steps() if isinstance(engine, RecordsDraftSteps) else []


class DraftStepRecorder:
    """A ``DraftBackend`` that passes every call through and remembers (tree, emitted tokens) per step."""

    def __init__(self, draft: DraftBackend) -> None:
        self.draft = draft
        self._proposed: dict[str, ProposedTree] = {}  # session -> tree awaiting its verification
        self._steps: list[tuple[ProposedTree, list[int]]] = []  # (tree, emitted tokens), in step order
        self._lock = threading.Lock()  # the engine thread records, the protocol's thread takes

    def step(self, batch: DraftBatch) -> DraftBatchResult:
        with self._lock:
            for accept in batch.accepts:
                tree = self._proposed.pop(accept.session_id, None)
                if tree is not None:
                    self._steps.append((tree, accept.emitted_tokens))
            for session_id in batch.releases:
                self._proposed.pop(session_id, None)
        result = self.draft.step(batch)
        with self._lock:
            self._proposed.update(result.trees)
        return result

    def take(self) -> list[DraftStep]:
        """Every step recorded since the last call, in the order the draft observed them."""
        with self._lock:
            steps, self._steps = self._steps, []
        return [observe(tree, emitted) for tree, emitted in steps]

    def close(self) -> None:
        close = getattr(self.draft, "close", None)  # a gRPC client; the in-process runtime holds nothing
        if close is not None:
            close()


class OnDeviceDraftStepRecorder(DraftStepRecorder):
    """A recorder around a draft in the target's process: the accepts it writes on the device while a verify runs
    (and the proposal it queues ahead behind them) pass through too, so a recorded run drafts as serving does.
    The steps are still recorded from ``step``: its trees include the ones queued ahead, and its accepts carry the
    emitted tokens that settle them."""

    draft: AcceptsOnDevice

    def accept_on_device(self, accepts: dict[str, DeviceAccept], ending: frozenset[str] = frozenset()) -> set[str]:
        return self.draft.accept_on_device(accepts, ending)


def recorder_around(draft: DraftBackend) -> DraftStepRecorder:
    """The recorder for ``draft``: one that passes the device-side accepts through where the draft takes them."""
    return OnDeviceDraftStepRecorder(draft) if isinstance(draft, AcceptsOnDevice) else DraftStepRecorder(draft)


class RecordingEngine(SpeculativeEngine):
    """The gateway's engine with its draft behind a ``DraftStepRecorder``."""

    def __init__(
        self, target: TargetBackend, draft: DraftBackend | None, tokenizer: Tokenizer, limits: EngineLimits
    ) -> None:
        self.recorder = recorder_around(draft) if draft is not None else None
        super().__init__(target, self.recorder, tokenizer, limits)

    def take_draft_steps(self) -> list[DraftStep]:
        return self.recorder.take() if self.recorder is not None else []


def build_recording_engine(settings: DiffSpecSettings) -> RecordingEngine:
    """``gateway.assembly.build_engine``'s in-process engine, its draft recorded."""
    target = build_target(settings)
    return RecordingEngine(target, build_draft(settings, target), load_tokenizer(settings), engine_limits(settings))
