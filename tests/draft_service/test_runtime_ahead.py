"""The proposal queued ahead (``DraftRuntime.accept_on_device`` with ``propose_ahead``): a step takes the trees the
runtime would have proposed after the accepts; a session that joins proposes beside it, and a session that ended
leaves its tree behind."""

from __future__ import annotations

import torch

from diffspec.device_accept import DeviceAccept
from diffspec.tree import DraftTree
from draft_service import drafter as drafter_module
from draft_service.backend import DraftAccept, DraftBatch, DraftStart
from draft_service.drafter import Drafter
from draft_service.options import DraftOptions
from draft_service.runtime import DraftRuntime
from tests.draft_service.test_drafter import load_head

OPTIONS = {"a": DraftOptions("full", "24:0.0:5"), "b": DraftOptions("full", "16:0.0:4", salience=True)}


def _start(runtime: DraftRuntime, sid: str, seed: int, options: DraftOptions | None = None) -> DraftStart:
    c = runtime.head.config
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, c.vocab_size, (40 + seed,), generator=generator).tolist()
    features = torch.randn(len(prompt), 3 * c.target_hidden_size, generator=generator)
    return DraftStart(sid, prompt, features, 1 + seed, options or OPTIONS[sid])


def _verified(tree, depth: int, bonus: int, seed: int, hidden: int) -> tuple[DraftAccept, DeviceAccept]:
    """The target's acceptance of a tree: its first child at each depth down to ``depth``, then ``bonus``; as the
    host reads it and as the device pads it to the tree's depth bound + 1."""
    host = DraftTree.of(tree)
    children, tokens = host.children(), host.token_list()
    node, emitted = 0, []
    while len(emitted) < depth and children[node]:
        node = children[node][0]
        emitted.append(tokens[node])
    emitted.append(bonus)
    features = torch.randn(len(emitted), hidden, generator=torch.Generator().manual_seed(seed))
    rows = tree.max_depth + 1
    padded = torch.cat([features, features[-1:].expand(rows - len(emitted), -1)])
    device = DeviceAccept(padded, torch.tensor(emitted + [bonus] * (rows - len(emitted))), torch.tensor(len(emitted)), rows)
    return DraftAccept("", emitted, features), device


def _observed_by_plans(runtime: DraftRuntime) -> dict[str, list[int]]:
    """From now on, per session, at each of its trees' plans: how many verified steps its hazard had observed."""
    seen: dict[str, list[int]] = {}
    launch = runtime._launch

    def recording(session_ids, plan):  # noqa: ANN001, ANN202
        for sid in session_ids:
            seen.setdefault(sid, []).append(runtime.sessions[sid].hazard.steps)
        return launch(session_ids, plan)

    runtime._launch = recording
    return seen


def _steps(propose_ahead: bool) -> tuple[list[list[int]], DraftRuntime]:
    """Session a alone for two steps; b joins at the third, beside a's proposal queued ahead; both for three; a
    ends at the sixth (announced: its last token was due), so the proposal queued then is b's alone; b alone at
    the last. Returns every tree's tokens and parents, and the runtime."""
    runtime = DraftRuntime(load_head(torch.device("cpu"), torch.float32), cuda_graphs=False, propose_ahead=propose_ahead)
    runtime.observed_by_plans = _observed_by_plans(runtime)
    runtime.observed_after_steps = []
    hidden = 3 * runtime.head.config.target_hidden_size
    trees = runtime.step(DraftBatch(starts=[_start(runtime, "a", 0)], proposes=["a"])).trees
    seen = []
    for step in range(7):
        accepts, on_device = [], {}
        for n, (sid, tree) in enumerate(sorted(trees.items())):
            host, device = _verified(tree, depth=(step + n) % 4, bonus=11 + step, seed=10 * step + n, hidden=hidden)
            accepts.append(DraftAccept(sid, host.emitted_tokens, host.features))
            on_device[sid] = device
            seen.append(DraftTree.of(tree).tokens.tolist() + DraftTree.of(tree).parents.tolist())
        ending = frozenset({"a"} if step == 5 else ())  # this verify emits a's last token
        assert runtime.accept_on_device(on_device, ending=ending) == set(on_device) - ending
        batch = DraftBatch(accepts=accepts, proposes=["a", "b"] if 2 <= step < 5 else ["a"] if step < 2 else ["b"])
        if step == 2:
            batch.starts.append(_start(runtime, "b", 3))
        if step == 5:  # a's request ended with this verify: no accept, a release
            batch = DraftBatch(releases=["a"], accepts=[a for a in accepts if a.session_id == "b"], proposes=["b"])
        trees = runtime.step(batch).trees
        runtime.observed_after_steps.append(sum(session.hazard.steps for session in runtime.sessions.values()))
    return seen, runtime


def test_the_trees_queued_ahead_are_the_ones_the_steps_would_propose():
    ahead, with_ahead = _steps(propose_ahead=True)
    after, without = _steps(propose_ahead=False)
    assert ahead == after
    assert (with_ahead.proposals_ahead, without.proposals_ahead) == (7, 0)  # b's first tree came beside a's
    assert with_ahead.proposals == without.proposals == 8  # batch plans: none queued in vain, none for b alone
    assert "a" not in with_ahead.sessions and not with_ahead.sessions["b"].drafter_state.unsettled


def test_a_step_taken_ahead_learns_its_verified_steps_behind_the_next_verify_and_plans_see_the_same():
    """A step that took its trees ahead leaves its verified steps unobserved (nothing on the device hides that
    host work) until the next verify's write; every plan still saw exactly what it saw without the proposal
    ahead."""
    _, with_ahead = _steps(propose_ahead=True)
    _, without = _steps(propose_ahead=False)
    assert with_ahead.observed_by_plans == without.observed_by_plans
    lag = [off - on for on, off in zip(with_ahead.observed_after_steps, without.observed_after_steps)]
    assert all(n >= 0 for n in lag) and sum(lag) >= 5  # the steps taken ahead left theirs for later


def test_an_online_session_that_joins_proposes_beside_within_the_batch_s_bound():
    """b (online, its own budget 64:8) joins online a (16:4) beside a's proposal queued ahead: its first tree keeps
    within the batch's bound, which b's join leaves as it was for the next batch plan to choose again."""
    runtime = DraftRuntime(load_head(torch.device("cpu"), torch.float32), cuda_graphs=False)
    small, large = DraftOptions("online", "16:0.0:4"), DraftOptions("online", "64:0.0:8")
    hidden = 3 * runtime.head.config.target_hidden_size
    trees = runtime.step(DraftBatch(starts=[_start(runtime, "a", 0, small)], proposes=["a"])).trees
    bound = runtime.batch_plan.bound
    assert bound is not None and (bound.tokens, bound.depth) == (16, 4)
    host, device = _verified(trees["a"], depth=2, bonus=11, seed=0, hidden=hidden)
    assert runtime.accept_on_device({"a": device}) == {"a"}
    assert not runtime.sessions.get("b") and runtime._ahead is not None  # queued for a alone
    accepts = [DraftAccept("a", host.emitted_tokens, host.features)]
    starts = [_start(runtime, "b", 3, large)]
    trees = runtime.step(DraftBatch(starts=starts, accepts=accepts, proposes=["a", "b"])).trees
    assert runtime.proposals_ahead == 1 and set(trees) == {"a", "b"}
    b = DraftTree.of(trees["b"])
    assert b.num_nodes <= 16 and b.max_depth <= 4
    assert bound.fits(runtime.sessions["b"].candidate) and runtime.batch_plan.bound == bound
    assert runtime._timed_proposal is not None and runtime._timed_proposal.beside  # its step measures no cost


def test_a_step_taken_ahead_scores_no_chunks_and_the_next_device_write_scores_them(monkeypatch):
    """The draft call that takes trees queued ahead runs between one verify's results and the next verify's launch:
    the chunks of the sessions it settles are not scored there but in the next device write, behind that verify,
    after the write took the selections queued before (whose copy is long done) rather than the ones it queues."""
    phase, events = ["loop"], []

    def marked(name: str, method):  # noqa: ANN001, ANN202
        def call(self, *args, **kwargs):  # noqa: ANN001, ANN202
            phase.append(name)
            try:
                return method(self, *args, **kwargs)
            finally:
                phase.pop()

        return call

    def scoring(self: Drafter) -> None:
        events.append((phase[-1], "score", len(self._to_rescore)))  # how many contexts this call scores
        rescore(self)

    rescore, take = Drafter.rescore, drafter_module.take_queued_selections
    monkeypatch.setattr(Drafter, "rescore", scoring)
    def taking(contexts: list) -> None:
        events.append((phase[-1], "take"))
        take(contexts)

    monkeypatch.setattr(drafter_module, "take_queued_selections", taking)
    monkeypatch.setattr(DraftRuntime, "step", marked("step", DraftRuntime.step))
    monkeypatch.setattr(DraftRuntime, "accept_on_device", marked("write", DraftRuntime.accept_on_device))
    _steps(propose_ahead=True)
    assert not [e for e in events if e[0] == "step" and e[1] == "score" and e[2]]  # the draft calls score nothing
    writes = [i for i, e in enumerate(events) if e == ("write", "take")]
    assert len(writes) == 7 and all(events[i + 1][:2] == ("write", "score") for i in writes)
    assert sum(events[i + 1][2] for i in writes) >= 3  # b's settled chunks were scored there (a's context fits whole)
