"""The engine loop: many requests advanced together, each as if it ran alone.

Every test runs the bundled tiny pair in fp32 on the CPU. Exactness is token for token: a
request in a crowd emits what it emits alone (greedy, and seeded sampling with a fixed tree
policy), a failing request changes nobody else's tokens, and every page and draft session is
free however a request ends.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import dataclass, replace
from typing import Iterator

import pytest

from diffspec.errors import DeadlineExceeded, InvalidRequest, PeerUnavailable, ResourceExhausted
from diffspec.sampling import SamplingParams
from diffspec.settings import BUNDLED_DRAFT, DiffSpecSettings
from diffspec.tree import DraftTree
from draft_service.inprocess import load_draft_runtime
from draft_service.options import DraftOptions
from draft_service.runtime import DraftRuntime
from gateway.engine import SpeculativeEngine
from gateway.engine_core import EngineCore, EngineLimits
from gateway.request import GenerationChunk, GenerationRequest
from target_service.backend import TargetBatch, TargetBatchResult, VerifyStep
from target_service.runtime import TargetRuntime
from tests.gateway.conftest import CODE_PROMPTS, assert_all_released, collect, collect_async
from tests.gateway.recording import RecordingDraft, RecordingTarget, recording_engine

NEW_TOKENS = 24
TEXTS = [
    *CODE_PROMPTS,
    "def add(a, b):",
    "for i in range(10):",
    "# sort a list of numbers\n",
    "import json\n\nwith open(path) as f:",
]
AUTO = None
CHAIN = DraftOptions("chain", "8:0.0:4")
FULL = DraftOptions("full", "16:0.0:4")
ONLINE = DraftOptions("online", "16:0.0:4", salience=True)
GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
LIMITS = EngineLimits(max_requests=64, max_batch_tokens=4096, prefill_chunk=2048)


@dataclass(frozen=True)
class Case:
    text: int  # index into TEXTS
    draft: DraftOptions | None
    sampling: SamplingParams = GREEDY


# Sixteen streams: every policy over shared and distinct prompts, two seeded sampling streams,
# and two whose sampling degenerates to greedy (a vanishing temperature, a vanishing top-p).
CROWD = [
    Case(0, AUTO), Case(0, FULL), Case(1, CHAIN), Case(1, ONLINE),
    Case(2, AUTO), Case(2, CHAIN), Case(3, FULL), Case(3, ONLINE),
    Case(4, FULL), Case(5, CHAIN), Case(6, ONLINE), Case(7, AUTO),
    Case(4, FULL, SEEDED), Case(5, AUTO, SEEDED),
    Case(6, FULL, SamplingParams(temperature=2e-38)), Case(7, CHAIN, SamplingParams(temperature=1.0, top_p=1e-300)),
]  # fmt: skip


@pytest.fixture(scope="module")
def target(tiny_target_dir) -> TargetRuntime:
    return TargetRuntime(DiffSpecSettings(base_model=tiny_target_dir, num_pages=512))


@pytest.fixture(scope="module")
def draft(target) -> DraftRuntime:
    return load_draft_runtime(DiffSpecSettings(draft_model=BUNDLED_DRAFT), target)


@pytest.fixture(scope="module")
def engine(target, draft, tokenizer) -> Iterator[SpeculativeEngine]:
    engine = recording_engine(target, draft, tokenizer, LIMITS)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer(text)["input_ids"] for text in TEXTS]


def long_prompt(ids: list[int], num_tokens: int) -> list[int]:
    """A prompt of ``num_tokens`` tokens: BOS, then the prompt's tokens over and over."""
    return [ids[0], *itertools.islice(itertools.cycle(ids[1:]), num_tokens - 1)]


def request(case: Case, prompt_ids: list[list[int]], new_tokens: int = NEW_TOKENS) -> GenerationRequest:
    return GenerationRequest(prompt_ids[case.text], new_tokens, case.sampling, draft=case.draft)


def crowd(engine: SpeculativeEngine, requests: list[GenerationRequest]) -> list[list[int] | BaseException]:
    """Every request in one iteration; each one's tokens, or the error it ended with.

    The target's gate holds the loop while the requests are submitted."""
    gate = engine.target.gate

    async def run() -> list:
        gate.clear()
        tasks = [asyncio.ensure_future(collect_async(engine, r)) for r in requests]
        while engine.core.num_requests < len(requests) and not any(t.done() for t in tasks):
            await asyncio.sleep(0)  # each task submits its request on its first run
        gate.set()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        return [o if isinstance(o, BaseException) else o[0] for o in outcomes]

    return asyncio.run(run())


# -- (a) a crowd equals its members alone ----------------------------------------------------


def test_sixteen_streams_each_equal_the_request_alone(engine, prompt_ids):
    alone = [collect(engine, request(case, prompt_ids))[0] for case in CROWD]
    auto = [collect(engine, GenerationRequest(ids, NEW_TOKENS))[0] for ids in prompt_ids]
    written_before = len(engine.draft.written_on_device)
    assert crowd(engine, [request(case, prompt_ids) for case in CROWD]) == alone
    # every drafting stream's accepted entries, greedy and sampled, were written from the device's acceptance
    # during its verify (draft and target share this process)
    drafting = sum(case.draft is not None for case in CROWD)
    assert max(len(written) for _, written in engine.draft.written_on_device[written_before:]) == drafting
    for case, tokens in zip(CROWD, alone):
        assert len(tokens) == NEW_TOKENS
        if case.sampling is not SEEDED:  # greedy, or sampling that only the argmax survives
            assert tokens == auto[case.text]
    assert alone[12] != auto[4] and alone[13] != auto[5]  # the seeded streams did sample
    assert max(engine.core.timing.batch_sizes) == 16  # the crowd was verified together
    assert_all_released(engine)



def test_with_accepts_off_the_device_the_crowd_is_the_same(engine, target, draft, tokenizer, prompt_ids):
    """``accept_on_device`` off: the draft commits every accept after the results, and each stream's tokens are
    those of the engine that writes greedy accepts during the verify."""
    requests = [request(case, prompt_ids) for case in CROWD]
    want = crowd(engine, requests)
    off = recording_engine(target, draft, tokenizer, replace(LIMITS, accept_on_device=False))
    try:
        assert crowd(off, requests) == want
    finally:
        off.close()
    assert off.draft.written_on_device == [] and len(off.draft.batches) > 0


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "sampled"])
def test_proposals_queued_ahead_give_the_drafting_crowd_the_same_tokens(engine, draft, prompt_ids, sampling):
    """Drafting streams alone: every session's accepts are written on the device (a sampled one's from its step's
    outcomes), so each step's proposal is queued behind the verify before it. With ``propose_ahead`` off the
    steps propose after the results, and each stream's tokens are the same. (Sampled streams with fixed policies
    only: an ``online`` tree follows measured costs, so which tokens it samples, not their law, varies by run.)"""
    cases = [
        replace(case, sampling=sampling)
        for case in CROWD
        if case.draft is not None and (sampling is GREEDY or case.draft.policy != "online")
    ]
    requests = [request(case, prompt_ids) for case in cases]
    taken_before = draft.proposals_ahead
    ahead = crowd(engine, requests)
    assert draft.proposals_ahead - taken_before >= NEW_TOKENS // 4  # the steps ran on proposals queued ahead
    draft.propose_ahead = False
    try:
        taken_before = draft.proposals_ahead
        assert crowd(engine, requests) == ahead
        assert draft.proposals_ahead == taken_before
    finally:
        draft.propose_ahead = True
    assert_all_released(engine)


class PlanCount:
    """The draft's batch plans from now on, against the steps that asked for a proposal."""

    def __init__(self, engine: SpeculativeEngine, draft: DraftRuntime) -> None:
        self.engine, self.draft = engine, draft
        self.plans, self.batches = draft.proposals, len(engine.draft.batches)

    def in_vain(self) -> int:
        """Proposals planned since that no step took (each step that proposed took one)."""
        proposing = sum(bool(batch.proposes) for _, batch in self.engine.draft.batches[self.batches :])
        return self.draft.proposals - self.plans - proposing


def test_a_request_that_starts_drafting_proposes_beside_the_others_proposal_queued_ahead(engine, draft, prompt_ids):
    """A stream joins two decoding ones: the step it starts drafting at takes the others' proposal queued ahead
    and proposes for it beside. Every step but the streams' first takes a proposal queued ahead, every proposal
    made is taken but the last one, queued behind the last verify before its request ended; and each stream's
    tokens are its own."""
    cases = [Case(0, FULL), Case(3, FULL), Case(2, CHAIN)]
    alone = [collect(engine, request(case, prompt_ids, 48))[0] for case in cases]
    plans, ahead_before = PlanCount(engine, draft), len(engine.draft.took_ahead)
    timeline = Timeline()
    for name, case in zip("ab", cases):
        engine.core.submit(name, request(case, prompt_ids, 48), timeline.sink(name))
    timeline.wait_until(lambda: len(timeline.tokens("a")) >= 12)  # a and b decode, c comes later
    engine.core.submit("c", request(cases[2], prompt_ids, 48), timeline.sink("c"))
    timeline.wait_until(lambda: all(timeline.finished(name) for name in "abc"))
    assert [timeline.tokens(name) for name in "abc"] == alone
    proposing = [batch for _, batch in engine.draft.batches[plans.batches :] if batch.proposes]
    took_ahead = engine.draft.took_ahead[ahead_before:]
    joined = next(i for i, batch in enumerate(proposing) if any(start.session_id == "c" for start in batch.starts))
    assert set(proposing[joined].proposes) == {"a", "b", "c"} and took_ahead[joined]
    assert took_ahead.count(False) == 1  # a and b's first step only
    assert plans.in_vain() == 1
    assert_all_released(engine)


def test_an_aborted_stream_leaves_the_others_proposals_queued_ahead_and_their_tokens(engine, draft, prompt_ids):
    """Three greedy drafting streams run on proposals queued ahead; one is aborted mid-stream. The next step
    takes the queued trees of the other two (the aborted one's is dropped), their tokens are their own, and the
    aborted one's pages and draft session are free."""
    cases, lengths = [Case(0, FULL), Case(3, FULL), Case(1, CHAIN)], [64, 64, 1000]  # v runs on till aborted
    alone = [collect(engine, request(case, prompt_ids, n))[0] for case, n in zip(cases, lengths)]
    taken, plans = draft.proposals_ahead, PlanCount(engine, draft)
    timeline = Timeline()
    for name, case, n in zip("abv", cases, lengths):
        engine.core.submit(name, request(case, prompt_ids, n), timeline.sink(name))
    timeline.wait_until(lambda: len(timeline.tokens("v")) >= 8)
    engine.core.abort("v")  # its client left: nothing more is sent to it
    timeline.wait_until(lambda: timeline.finished("a") and timeline.finished("b") and not engine.core.num_requests)
    assert [timeline.tokens(name) for name in "ab"] == alone[:2]
    assert timeline.tokens("v") == alone[2][: len(timeline.tokens("v"))] and len(timeline.tokens("v")) < 1000
    assert draft.proposals_ahead - taken >= 64 // 4  # the survivors kept running on queued proposals
    # one proposal in vain, the last one's: the aborted stream's and each ended one's left the others theirs
    assert plans.in_vain() == 1
    assert_all_released(engine)


def test_a_request_with_one_token_left_takes_it_in_an_auto_step(engine, draft, prompt_ids):
    """One token left: whatever its next verify accepts ends the request, so that verify is an Auto step (no tree),
    and the draft proposes nothing for it. The stream beside it still runs on proposals queued ahead at that
    step, announced as ending; the tokens are each one's own."""
    longer = Timeline()
    engine.core.submit("longer", request(Case(0, FULL), prompt_ids, 48), longer.sink("longer"))
    longer.wait_until(lambda: longer.finished("longer"))
    emitted = list(itertools.accumulate(len(c.token_ids) for c in longer.chunks("longer") if c.token_ids))
    max_new_tokens = emitted[3] + 1  # the prompt's token, three verifies, then one token left
    alone = collect(engine, request(Case(3, CHAIN), prompt_ids, 48))[0]
    plans, verifies_before = PlanCount(engine, draft), len(engine.target.batches)
    ahead_before = len(engine.draft.took_ahead)
    timeline = Timeline()
    engine.target.gate.clear()  # both reach the same iterations
    engine.core.submit("short", request(Case(0, FULL), prompt_ids, max_new_tokens), timeline.sink("short"))
    engine.core.submit("beside", request(Case(3, CHAIN), prompt_ids, 48), timeline.sink("beside"))
    engine.target.gate.set()
    timeline.wait_until(lambda: timeline.finished("short") and timeline.finished("beside"))
    assert timeline.tokens("short") == longer.tokens("longer")[:max_new_tokens]
    assert timeline.tokens("beside") == alone
    trees = [v.tree for _, b in engine.target.batches[verifies_before:] for v in b.verifies if v.session_id == "short"]
    assert [tree.num_nodes > 1 for tree in trees] == [True, True, True, False]
    batches = [batch for _, batch in engine.draft.batches[plans.batches :]]
    asked = [batch.proposes for batch in batches if "short" in {a.session_id for a in batch.accepts}]
    assert [("short" in proposes) for proposes in asked] == [True, True, False]
    # every proposal but the streams' first was queued ahead, the one of the step "short" ended at too (the
    # proposal behind its third verify held both trees: "beside" took its own); only the last went in vain
    assert engine.draft.took_ahead[ahead_before:].count(False) == 1
    assert plans.in_vain() == 1
    assert_all_released(engine)


def test_closing_the_engine_frees_everything_and_refuses_what_comes_after(target, draft, tokenizer, prompt_ids):
    """Backends that outlive an engine (shared runtimes, remote services) keep nothing of its requests, whether
    they ended just before the close or still ran; the running one ends UNAVAILABLE, and so does a later one."""
    engine = recording_engine(target, draft, tokenizer, LIMITS)
    timeline = Timeline()
    crowd(engine, [request(case, prompt_ids) for case in CROWD[:4]])  # ended: their releases may still be queued
    engine.core.submit("running", GenerationRequest(prompt_ids[0], 4000, draft=FULL), timeline.sink("running"))
    timeline.wait_until(lambda: timeline.tokens("running"))
    engine.close()
    failure = timeline.chunks("running")[-1]
    assert isinstance(failure, PeerUnavailable) and "shutting down" in str(failure)
    info = target.info()  # at once: the close sent every release
    assert info.num_free_pages == info.num_pages and info.active_sessions == 0 and not draft.sessions
    assert engine.core.num_requests == 0
    with pytest.raises(PeerUnavailable, match="shutting down"):
        engine.core.submit("late", GenerationRequest(prompt_ids[0], 4), Timeline().sink("late"))

# -- (b) a failing request fails alone ------------------------------------------------------


class TreeCorruptingTarget(RecordingTarget):
    """Hands one prompt's session, at its ``at``-th verification, a tree whose root is not its
    last token: the runtime must reject that tree alone."""

    def __init__(self, inner: TargetRuntime, prompt_ids: list[int], at: int) -> None:
        super().__init__(inner)
        self.prompt_ids, self.at = prompt_ids, at
        self.victim: str | None = None
        self.verifies = 0
        self.batch_at_failure = 0  # verifications in the batch that carried the bad tree

    def step(self, batch: TargetBatch) -> TargetBatchResult:
        for opening in batch.opens:
            if opening.prompt_ids == self.prompt_ids:
                self.victim = opening.session_id
        return super().step(replace(batch, verifies=[self._maybe_corrupt(v, batch) for v in batch.verifies]))

    def _maybe_corrupt(self, step: VerifyStep, batch: TargetBatch) -> VerifyStep:
        if step.session_id != self.victim:
            return step
        self.verifies += 1
        if self.verifies != self.at:
            return step
        self.batch_at_failure = len(batch.verifies)
        tree = DraftTree.of(step.tree)
        tokens = tree.tokens.clone()
        tokens[0] = (tokens[0] + 1) % self.inner.info().vocab_size
        return VerifyStep(step.session_id, DraftTree(tokens, tree.parents, tree.draft_probs))


def test_failing_requests_change_no_other_output(target, draft, tokenizer, prompt_ids):
    healthy = [Case(0, AUTO), Case(1, FULL), Case(2, ONLINE), Case(3, CHAIN), Case(4, FULL, SEEDED)]
    with_bad_tree = Case(5, FULL)
    wrapped = TreeCorruptingTarget(target, prompt_ids[with_bad_tree.text], at=3)
    engine = SpeculativeEngine(wrapped, draft, tokenizer, LIMITS)
    wrapped.core = engine.core
    try:
        alone = [collect(engine, request(case, prompt_ids))[0] for case in healthy]
        out_of_vocab = GenerationRequest([*prompt_ids[6], 9000], NEW_TOKENS, draft=FULL)  # fails at its open
        outcomes = crowd(engine, [request(c, prompt_ids) for c in (*healthy, with_bad_tree)] + [out_of_vocab])
        assert outcomes[: len(healthy)] == alone
        bad_tree, bad_prompt = outcomes[len(healthy) :]
        assert isinstance(bad_tree, InvalidRequest) and "not the session's last token" in str(bad_tree)
        assert isinstance(bad_prompt, InvalidRequest) and "out of the vocabulary" in str(bad_prompt)
        assert wrapped.batch_at_failure == 6  # the bad tree was verified beside every healthy stream
        assert_all_released(engine)
    finally:
        engine.close()


# -- the loop's own order, read from one timeline of every request's chunks -----------------


class Timeline:
    """Every chunk of every request, in the order the engine thread handed them out."""

    def __init__(self) -> None:
        self.events: list[tuple[str, GenerationChunk | BaseException]] = []
        self._done: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def sink(self, name: str) -> _NamedSink:
        self._done[name] = threading.Event()
        return _NamedSink(self, name)

    def record(self, name: str, item: GenerationChunk | BaseException) -> None:
        with self._lock:
            self.events.append((name, item))
        if isinstance(item, BaseException) or item.stats is not None:
            self._done[name].set()

    def wait_until(self, condition, timeout: float = 30.0) -> None:  # noqa: ANN001
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, "the engine did not get there in time"
            time.sleep(0.002)

    def finished(self, name: str) -> bool:
        return self._done[name].is_set()

    def chunks(self, name: str) -> list[GenerationChunk]:
        return [c for n, c in self.events if n == name]

    def tokens(self, name: str) -> list[int]:
        return [t for c in self.chunks(name) for t in c.token_ids]


@dataclass
class _NamedSink:
    timeline: Timeline
    name: str

    def put(self, chunk: GenerationChunk) -> None:
        self.timeline.record(self.name, chunk)

    def fail(self, error: BaseException) -> None:
        self.timeline.record(self.name, error)


# -- (c) chunked prefill interleaves with decoding ------------------------------------------


def test_a_long_prefill_does_not_stall_a_decoding_stream(target, draft, tokenizer, engine, prompt_ids):
    long_ids = long_prompt(prompt_ids[1], 160)
    want_short = collect(engine, GenerationRequest(prompt_ids[0], 64))[0]
    want_long = collect(engine, GenerationRequest(long_ids, NEW_TOKENS))[0]
    core = EngineCore(target, draft, tokenizer, EngineLimits(max_requests=8, max_batch_tokens=64, prefill_chunk=16))
    timeline = Timeline()
    try:
        core.submit("short", GenerationRequest(prompt_ids[0], 64), timeline.sink("short"))
        timeline.wait_until(lambda: timeline.tokens("short"))  # decoding before the long prompt arrives
        core.submit("long", GenerationRequest(long_ids, NEW_TOKENS, draft=FULL), timeline.sink("long"))
        timeline.wait_until(lambda: timeline.finished("short") and timeline.finished("long"))
    finally:
        core.close()
    assert timeline.tokens("short") == want_short and timeline.tokens("long") == want_long
    long_chunks = timeline.chunks("long")
    progress = [c.prefill_progress for c in long_chunks if c.prefill_progress is not None]
    assert progress == [(done, 160) for done in range(16, 160, 16)]  # one 16-token chunk per iteration
    order = [(name, chunk) for name, chunk in timeline.events]
    first_progress = next(i for i, (n, c) in enumerate(order) if n == "long")
    first_token = next(i for i, (n, c) in enumerate(order) if n == "long" and c.token_ids)
    short_meanwhile = [c for n, c in order[first_progress:first_token] if n == "short"]
    # each prefill iteration also verified the short stream, the one computing the last chunk too (whose
    # first token the next iteration collects)
    assert [len(c.token_ids) for c in short_meanwhile] == [1] * (len(progress) + 1)


# -- (d) cancellation and deadlines free everything -----------------------------------------


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_closing_the_stream_frees_every_page_and_draft_session(target, draft, tokenizer, prompt_ids, phase):
    engine = SpeculativeEngine(target, draft, tokenizer, EngineLimits(8, 64, 16))
    ids = long_prompt(prompt_ids[2], 400)

    async def leave_early() -> GenerationChunk:
        stream = engine.generate(GenerationRequest(ids, 500, draft=FULL))
        chunk = await stream.__anext__()
        while phase == "decode" and not chunk.token_ids:
            chunk = await stream.__anext__()
        await stream.aclose()
        return chunk

    try:
        last = asyncio.run(leave_early())
        assert (last.prefill_progress == (16, 400)) if phase == "prefill" else last.token_ids
        assert_all_released(engine)
        assert engine.core.num_requests == 0
    finally:
        engine.close()


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_a_passed_deadline_raises_and_frees_everything(target, draft, tokenizer, prompt_ids, phase):
    engine = SpeculativeEngine(target, draft, tokenizer, EngineLimits(8, 64, 16))
    ids = long_prompt(prompt_ids[3], 4000) if phase == "prefill" else prompt_ids[3]
    timeout = 0.1 if phase == "prefill" else 0.3  # 250 prompt chunks take longer; 0.3 s leaves time to decode
    received: list[GenerationChunk] = []

    async def run() -> None:
        async for chunk in engine.generate(GenerationRequest(ids, 4000, draft=FULL), timeout=timeout):
            received.append(chunk)

    try:
        with pytest.raises(DeadlineExceeded):
            asyncio.run(run())
        tokens = [t for c in received for t in c.token_ids]
        assert (not tokens) if phase == "prefill" else 0 < len(tokens) < 4000
        assert_all_released(engine)
        assert engine.core.num_requests == 0
    finally:
        engine.close()


# -- (e) admission ---------------------------------------------------------------------------


def test_requests_past_the_admission_limit_are_refused(target, draft, tokenizer, prompt_ids):
    limits = EngineLimits(max_requests=2, max_batch_tokens=64, prefill_chunk=16)
    engine = SpeculativeEngine(target, draft, tokenizer, limits)

    async def run() -> list[int]:
        streams = [engine.generate(GenerationRequest(prompt_ids[i], 500, draft=FULL)) for i in range(2)]
        for stream in streams:
            await stream.__anext__()
        assert engine.core.num_requests == 2
        with pytest.raises(ResourceExhausted):
            await engine.generate(GenerationRequest(prompt_ids[2], 4)).__anext__()
        await streams[0].aclose()
        while engine.core.num_requests > 1:
            await asyncio.sleep(0.002)
        third = (await collect_async(engine, GenerationRequest(prompt_ids[2], 4)))[0]
        await streams[1].aclose()
        return third

    try:
        assert len(asyncio.run(run())) == 4
        assert_all_released(engine)
    finally:
        engine.close()


# -- (f) one target call per iteration -------------------------------------------------------


def test_every_decoding_stream_is_verified_in_one_target_call(target, draft, tokenizer, prompt_ids):
    engine = recording_engine(target, draft, tokenizer, LIMITS)
    cases = [Case(0, AUTO), Case(1, FULL), Case(2, AUTO), Case(3, FULL)]
    try:
        outcomes = crowd(engine, [request(case, prompt_ids) for case in cases])
        assert all(len(tokens) == NEW_TOKENS for tokens in outcomes)
        assert_all_released(engine)
        for calls in (engine.target.batches, engine.draft.batches):
            iterations = [iteration for iteration, _ in calls]
            assert iterations == sorted(set(iterations))  # at most one call of each service per iteration
        target_batches = [batch for _, batch in engine.target.batches]
        verify_sizes = [len(b.verifies) for b in target_batches if b.verifies]
        assert verify_sizes == engine.core.timing.batch_sizes
        assert [b.padded_rows for b in target_batches if b.verifies] == engine.core.timing.padded_rows
        prompt_calls = sum(bool(b.prefills) for b in target_batches)
        assert engine.core.timing.prompt_iterations == prompt_calls > 0 and engine.core.timing.prompt_ms > 0
        prompt_tokens = sum(work.num_tokens for b in target_batches for work in b.prefills)
        assert engine.core.timing.prompt_tokens == prompt_tokens == sum(len(prompt_ids[case.text]) for case in cases)
        assert 0 < engine.core.timing.slowest_prompt_seconds <= engine.core.timing.prompt_seconds
        together = verify_sizes.index(4)  # 0, or 1 when the loop took the first request alone
        assert together <= 1 and verify_sizes[together : together + 3] == [4, 4, 4]
        first_four = next(b for b in target_batches if len(b.verifies) == 4)
        roots_only = sorted(step.tree.num_nodes == 1 for step in first_four.verifies)
        assert roots_only == [False, False, True, True]  # two Auto steps beside two speculative trees
        assert max(len(b.proposes) for _, b in engine.draft.batches) == 2  # both trees from one draft call
    finally:
        engine.close()


class FixedVerifyTimeTarget(RecordingTarget):
    """Reports every verify as taking ``seconds`` on the device over ``rows`` computed rows (None: unmeasured,
    as over the wire)."""

    def __init__(self, inner: TargetRuntime, seconds: float | None, rows: int | None) -> None:
        super().__init__(inner)
        self.seconds, self.rows = seconds, rows

    def step(self, batch: TargetBatch) -> TargetBatchResult:
        result = super().step(batch)
        if not result.verifies:
            return replace(result, verify_seconds=None, verify_rows=None)
        return replace(result, verify_seconds=self.seconds, verify_rows=self.rows)


@pytest.mark.parametrize("reported", [(1234.5, 4096), (None, None)], ids=["device-span", "wall-time"])
def test_the_draft_learns_the_verify_cost_the_target_measured(target, draft, tokenizer, prompt_ids, reported):
    """A verify-only iteration's cost reaches the next draft call: the target's device span and the rows its
    forward computed (a step graph's whole bucket) when it reports them (the verify runs behind a pending
    proposal, so the call's wall time holds the proposal too), else the call's wall time over the batch's
    requested rows."""
    seconds, rows = reported
    timed = FixedVerifyTimeTarget(target, seconds, rows)
    recording = RecordingDraft(draft)
    engine = SpeculativeEngine(timed, recording, tokenizer, LIMITS)
    timed.core = recording.core = engine.core
    try:
        collect(engine, GenerationRequest(prompt_ids[0], NEW_TOKENS, draft=FULL))
        costs = [batch.verify_cost for _, batch in recording.batches if batch.verify_cost is not None]
        verified = {it: batch for it, batch in timed.batches if batch.verifies and not batch.prefills}
        assert len(costs) >= 3
        for (it, batch), cost in zip(sorted(verified.items()), costs):
            requested = len(batch.verifies) * max(v.tree.num_nodes for v in batch.verifies)
            assert batch.padded_rows == requested and cost.rows == (rows if rows is not None else requested)
        if seconds is not None:
            assert {cost.seconds for cost in costs} == {seconds}
        else:
            assert all(0.0 < cost.seconds < 60.0 for cost in costs)
        assert_all_released(engine)
    finally:
        engine.close()


class ResettingTarget(RecordingTarget):
    """Clears the loop's timing in the middle of its next step, as a benchmark resets it between runs."""

    def __init__(self, inner: TargetRuntime) -> None:
        super().__init__(inner)
        self.reset_next = False

    def step(self, batch: TargetBatch) -> TargetBatchResult:
        result = super().step(batch)
        if self.reset_next:
            self.reset_next = False
            self.core.timing.reset()
        return result


def test_a_timing_reset_during_a_call_keeps_no_earlier_seconds(target, draft, tokenizer, prompt_ids):
    """The backends' seconds after a reset are the calls' since it, within the loop's own seconds."""
    resetting = ResettingTarget(target)
    recording = RecordingDraft(draft)
    engine = SpeculativeEngine(resetting, recording, tokenizer, LIMITS)
    resetting.core = recording.core = engine.core
    try:
        collect(engine, GenerationRequest(prompt_ids[0], NEW_TOKENS, draft=FULL))
        before = engine.core.timing.target_seconds
        resetting.reset_next = True
        collect(engine, GenerationRequest(prompt_ids[1], 2))
        timing = engine.core.timing
        assert not resetting.reset_next and before > 0
        assert 0 < timing.draft_seconds + timing.target_seconds <= timing.loop_seconds
        assert timing.target_seconds < before
    finally:
        engine.close()
