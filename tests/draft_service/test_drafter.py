"""Draft trees proposed on the device against the host-side search they replaced, for every policy shape.

Sessions are started over seeded random prompts and features (no target needed), with
contexts of different lengths in one batch, with and without a salience working set.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

import draft_service.drafter

from diffspec.settings import BUNDLED_DRAFT, BUNDLED_TARGET
from diffspec.tree import DraftTree
from draft_service.drafter import Drafter, DraftSession, Extension, ProposalRequest
from draft_service.eagle3_head import Eagle3Head
from draft_service.hazard import widths_to_plan
from draft_service.serving_weights import Quantization
from draft_service.target_embedding import load_target_embedding
from draft_service.tree_budget import DepthPlan, TreeBudget
from draft_service.tree_proposal import ROOT_TOKEN, ProposalShape, bucketed_widths, full_widths
from draft_service.tree_search import TreeTensors
from draft_service.working_set import WorkingSetConfig
from tests.draft_service.reference_proposal import reference_tree, root_output

CONTEXT_LENGTHS = (5, 37, 150, 300)  # one batch, four contexts
SALIENCE = WorkingSetConfig(chunk_size=16, budget_tokens=96, sink_chunks=1, recent_chunks=2)  # a strict subset at 300

# policy shape -> (plan, budget): what tree_plan.fixed_candidate and hazard.widths_to_plan give for each policy
POLICIES = {
    "chain": ([DepthPlan(1, 1)] * 6, TreeBudget(64, 0.0, 6)),
    "uniform2": ([DepthPlan(7, 2)] * 3, TreeBudget(15, 0.0, 3)),
    "uniform3": ([DepthPlan(14, 3)] * 4, TreeBudget(40, 0.0, 4)),
    "full": ([DepthPlan(10, 10)] * 8, TreeBudget(64, 0.0, 8)),
    "full-threshold": ([DepthPlan(10, 10)] * 5, TreeBudget(40, 0.01, 5)),
    "online": (widths_to_plan([4, 2, 1, 3, 1]), TreeBudget(32, 0.0, 6)),
    "online-threshold": (widths_to_plan([6, 3, 2]), TreeBudget(24, 0.01, 3)),
}


def load_head(device: torch.device, dtype: torch.dtype, num_layers: int = 1) -> Eagle3Head:
    """The bundled head; with ``num_layers`` > 1, its layer 0 under seeded randomly initialised layers."""
    embedding = load_target_embedding(BUNDLED_TARGET, device, dtype)
    head = Eagle3Head.load(BUNDLED_DRAFT, embedding, device, dtype)
    if num_layers == 1:
        return head
    torch.manual_seed(0)
    deep = Eagle3Head(replace(head.config, num_layers=num_layers), embedding)
    deep.load_state_dict(head.state_dict(), strict=False)
    return deep


def start_sessions(
    drafter: Drafter, lengths: tuple[int, ...], salience: WorkingSetConfig | None, seed: int = 0
) -> list[DraftSession]:
    """Sessions over random prompts [length] and features [length, 3 * hidden], the same for a seed."""
    c, device = drafter.head.config, drafter.head.fc.weight.device
    generator = torch.Generator().manual_seed(seed)
    sessions = []
    for length in lengths:
        prompt = torch.randint(0, c.vocab_size, (length + 1,), generator=generator).tolist()
        features = torch.randn(length, 3 * c.target_hidden_size, generator=generator)
        sessions.append(drafter.start(prompt[:-1], features.to(device), prompt[-1], salience))
    return sessions


@pytest.fixture(scope="module")
def drafter() -> Drafter:
    return Drafter(load_head(torch.device("cpu"), torch.float32), cuda_graphs=False)


def assert_same_tree(got: DraftTree, want: DraftTree) -> None:
    assert got.tokens.tolist() == want.tokens.tolist()
    assert got.parents.tolist() == want.parents.tolist()
    torch.testing.assert_close(got.draft_probs, want.draft_probs, rtol=1e-5, atol=1e-6)


def cumulative_probs(tree: DraftTree) -> list[float]:
    cumulative = [1.0]
    for node in range(1, tree.num_nodes):
        cumulative.append(cumulative[int(tree.parents[node])] * float(tree.draft_probs[node]))
    return cumulative


@pytest.mark.parametrize("salience", [None, SALIENCE], ids=["full-context", "salience"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_device_trees_equal_the_host_search(drafter, policy, salience):
    plan, budget = POLICIES[policy]
    sessions = start_sessions(drafter, CONTEXT_LENGTHS, salience)
    requests = [ProposalRequest(session, plan, budget) for session in sessions]
    trees = drafter.propose_many(requests)
    for request, tree in zip(requests, trees):
        assert_same_tree(tree, reference_tree(drafter, request))
        assert tree.num_nodes <= budget.total_tokens
        assert int(tree.depths().max()) <= min(len(plan), budget.depth)
        assert all(p >= budget.threshold - 1e-6 for p in cumulative_probs(tree))
    assert sum(tree.num_nodes for tree in trees) >= 2 * len(trees)  # trees, not roots alone
    if budget.threshold > 0:  # the threshold did cut: some tree is smaller than the same search without it
        unpruned = [ProposalRequest(s, plan, TreeBudget(budget.total_tokens, 0.0, budget.depth)) for s in sessions]
        sizes = [t.num_nodes for t in drafter.propose_many(unpruned)]
        assert any(tree.num_nodes < size for tree, size in zip(trees, sizes))
    if salience is not None:  # the longest context attends to a strict subset
        assert sessions[-1].context.view(0)[0].shape[0] < CONTEXT_LENGTHS[-1]


@pytest.mark.parametrize("salience", [None, SALIENCE], ids=["full-context", "salience"])
def test_int8_matmuls_grow_the_trees_the_host_search_grows_with_them(drafter, salience):
    """With every serving matmul in int8, the device proposal still equals the host search over the same
    weights, and the weights are int8 indeed: the trees' draft probabilities move off the float head's."""
    int8 = Drafter(drafter.head, cuda_graphs=False, quantization="int8")
    plan, budget = POLICIES["full"]
    requests = [ProposalRequest(s, plan, budget) for s in start_sessions(int8, CONTEXT_LENGTHS, salience)]
    floats = [ProposalRequest(s, plan, budget) for s in start_sessions(drafter, CONTEXT_LENGTHS, salience)]
    trees = int8.propose_many(requests)
    for request, tree in zip(requests, trees):
        assert_same_tree(tree, reference_tree(int8, request))
    moved = [not torch.allclose(t.draft_probs[1:2], f.draft_probs[1:2], rtol=0, atol=1e-6)
             for t, f in zip(trees, drafter.propose_many(floats))]  # fmt: skip
    assert any(moved)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_pending_tree_s_bounds_hold_its_tree_and_are_exact_without_a_threshold(drafter, policy):
    """The bounds a target sizes its verify by, before it reads the nodes: the tree's own plan's."""
    plan, budget = POLICIES[policy]
    requests = [ProposalRequest(s, plan, budget) for s in start_sessions(drafter, CONTEXT_LENGTHS, None)]
    for pending in drafter.propose_pending(requests):
        tree = pending.tree()
        assert tree.max_depth <= pending.max_depth == min(len(plan), budget.depth)
        assert torch.equal(pending.on_device.tokens[: tree.num_nodes].cpu(), tree.tokens)
        if budget.threshold == 0:
            assert tree.num_nodes == pending.num_nodes
        else:
            assert tree.num_nodes <= pending.num_nodes


def test_one_batch_mixes_plans_budgets_thresholds_and_salience(drafter):
    """Widths, depths, budgets and thresholds differ per session: each pads to the batch's widest and is masked."""
    full_context = start_sessions(drafter, CONTEXT_LENGTHS, None, seed=1)
    selected = start_sessions(drafter, CONTEXT_LENGTHS[::-1], SALIENCE, seed=2)
    shapes = list(POLICIES.values())
    requests = [ProposalRequest(s, *shapes[i % len(shapes)]) for i, s in enumerate(full_context + selected)]
    for request, tree in zip(requests, drafter.propose_many(requests)):
        assert_same_tree(tree, reference_tree(drafter, request))


def test_reused_buffers_leave_no_trace(drafter):
    """A shape's static buffers serve the next batch of that shape: shorter contexts and new sessions see none
    of the last batch's keys or entries."""
    plan, budget = POLICIES["full"]
    fresh = Drafter(drafter.head, cuda_graphs=False)
    long_sessions = start_sessions(fresh, (300, 280, 260), None, seed=3)
    short_sessions = start_sessions(fresh, (9, 4, 20), None, seed=4)
    first = fresh.propose_many([ProposalRequest(s, plan, budget) for s in long_sessions])
    requests = [ProposalRequest(s, plan, budget) for s in short_sessions]
    for request, tree in zip(requests, fresh.propose_many(requests)):
        assert_same_tree(tree, reference_tree(fresh, request))
    again = fresh.propose_many([ProposalRequest(s, plan, budget) for s in long_sessions])
    for one, other in zip(first, again):
        assert_same_tree(one, other)
    assert len(fresh.proposer._runs) == 1  # one shape, one set of buffers


def test_device_tree_matches_the_host_tree(drafter):
    plan, budget = POLICIES["online"]
    sessions = start_sessions(drafter, CONTEXT_LENGTHS, None)
    for pending in drafter.propose_pending([ProposalRequest(s, plan, budget) for s in sessions]):
        tree = pending.tree()
        device, n = pending.on_device, tree.num_nodes
        assert int(device.num_nodes) == n
        assert torch.equal(device.tokens[:n], tree.tokens) and torch.equal(device.parents[:n], tree.parents)
        assert torch.equal(device.depths[:n], tree.depths())
        assert torch.equal(device.ancestor_mask[:n, :n], tree.ancestor_mask())
        capacity = device.tokens.shape[0]
        assert bool((device.parents[n:] == -1).all()) and bool((device.tokens[n:] == 0).all())
        assert torch.equal(device.ancestor_mask[n:], torch.eye(capacity, dtype=torch.bool)[n:])  # padding sees itself


def test_the_search_reads_nothing_back_to_the_host(drafter, monkeypatch):
    """Every choice of a proposal is a tensor op: no host read inside it (a GPU would sync on one)."""
    plan, budget = POLICIES["full-threshold"]
    sessions = start_sessions(drafter, CONTEXT_LENGTHS, SALIENCE)
    requests = [ProposalRequest(s, plan, budget) for s in sessions]
    proposer = drafter.proposer
    contexts = [s.context for s in sessions]
    lengths = [c.attended_tokens for c in contexts]
    run = proposer._stage(ProposalShape.of(requests, lengths), requests, contexts, lengths)

    def host_read(*_args, **_kwargs):
        raise AssertionError("a host read inside the proposal")

    with monkeypatch.context() as patch, torch.no_grad():
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy"):
            patch.setattr(torch.Tensor, name, host_read)
        out = proposer._search(run)
    trees = drafter.propose_many(requests)
    assert out.num_nodes[: len(trees)].tolist() == [t.num_nodes for t in trees]


@pytest.mark.parametrize(
    "plans, lengths, want",
    [
        ([POLICIES["full"]] * 3, [5, 300, 40], ProposalShape(4, 1024, full_widths(8), 64)),
        ([POLICIES["uniform2"]], [1025], ProposalShape(1, 1152, ((1, 10), (10, 10), (10, 10)), 16)),
        ([POLICIES["chain"]] * 2, [4500, 3], ProposalShape(2, 4608, ((1, 10),) + ((10, 10),) * 5, 8)),
        (  # online widths up to the full tree's: its widths, whatever each session's
            [(widths_to_plan([5, 2]), TreeBudget(16, 0.0, 2)), (widths_to_plan([1, 7, 3]), TreeBudget(24, 0.0, 3))],
            [70_000, 10],
            ProposalShape(2, 73_728, full_widths(3), 32),
        ),
        (  # a wider plan: each depth takes the batch's widest, rounded up to a width bucket
            [(widths_to_plan([5, 2]), TreeBudget(16, 0.0, 2)), (widths_to_plan([1, 12, 3]), TreeBudget(24, 0.0, 3))],
            [70_000, 10],
            ProposalShape(2, 73_728, ((1, 6), (6, 12), (12, 3)), 32),
        ),
        ([POLICIES["uniform3"]], [10], ProposalShape(1, 1024, ((1, 3), (3, 3), (9, 3), (16, 3)), 48)),  # expands 14
    ],
)
def test_shapes_pad_to_buckets(drafter, plans, lengths, want):
    session = start_sessions(drafter, (3,), None)[0]
    requests = [ProposalRequest(session, plan, budget) for plan, budget in plans]
    assert ProposalShape.of(requests, lengths) == want


SHAPED = (widths_to_plan([4, 3, 2, 1]), TreeBudget(25, 0.0, 4))
PLAN_MIXES = {  # one batch's plans, session i taking plan i % len
    "chain": [POLICIES["chain"]],
    "uniform2": [POLICIES["uniform2"]],
    "shaped": [SHAPED],
    "mixed": [POLICIES["chain"], POLICIES["uniform2"], SHAPED, POLICIES["online-threshold"]],
    "full-and-chain": [POLICIES["full"], POLICIES["chain"]],  # the full tree's own widths, a chain beside it
}


def _proposals_on_both_widths(
    drafter: Drafter, plans: list[tuple[list[DepthPlan], TreeBudget]]
) -> tuple[TreeTensors, TreeTensors]:
    """The same requests' TreeTensors on the full tree's widths (what ``ProposalShape.of`` picks), then on the
    batch's own bucketed widths."""
    sessions = start_sessions(drafter, CONTEXT_LENGTHS, None, seed=6)
    requests = [ProposalRequest(s, *plans[i % len(plans)]) for i, s in enumerate(sessions)]
    contexts = [s.context for s in sessions]
    lengths = [c.attended_tokens for c in contexts]
    canonical = ProposalShape.of(requests, lengths)
    exact = replace(canonical, widths=bucketed_widths([r.plan[: r.budget.depth] for r in requests]))
    assert canonical.widths == full_widths(canonical.depth)
    with torch.no_grad():
        got, want = (
            drafter.proposer._search(drafter.proposer._stage(shape, requests, contexts, lengths))
            for shape in (canonical, exact)
        )
    return got, want


@pytest.mark.parametrize("mix", list(PLAN_MIXES))
def test_padded_rows_and_children_are_masked_bit_for_bit(drafter, monkeypatch, mix):
    """With a stand-in head whose children (log-probs from a few levels, so ties are common) are a fixed
    function of a row's token, the search on the full tree's widths equals the one on the bucketed widths,
    every field bit for bit: what a padded frontier row or child adds is never a candidate."""
    vocab, gen = 50, torch.Generator().manual_seed(7)
    levels = torch.tensor([-0.5, -1.0, -2.0, -3.0])
    table_log_probs = levels[torch.randint(4, (vocab, 10), generator=gen)].sort(dim=1, descending=True).values
    table_tokens = torch.randint(vocab, (vocab, 10), generator=gen)
    proposer = type(drafter.proposer)
    monkeypatch.setattr(proposer, "_root_pass", lambda self, run: run.facts[:, ROOT_TOKEN, None, None] % vocab)
    monkeypatch.setattr(proposer, "_head_pass", lambda self, run, depth, frontier, *_: frontier.tokens[..., None])
    monkeypatch.setattr(
        proposer, "_top_children",
        lambda self, tokens, k: (table_log_probs[tokens[..., 0]][..., :k], table_tokens[tokens[..., 0]][..., :k]),
    )  # fmt: skip
    got, want = _proposals_on_both_widths(drafter, PLAN_MIXES[mix])
    assert int(got.num_nodes.min()) > 1
    for name in ("tokens", "parents", "draft_probs", "depths", "ancestor_mask", "num_nodes", "host_rows"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


@pytest.mark.parametrize("mix", list(PLAN_MIXES))
def test_the_full_tree_s_widths_give_the_bucketed_widths_trees(drafter, mix):
    """The same with the bundled head: the same trees. Only the draft probabilities may differ, in the last
    bits: the head's matmuls over more rows round differently (a CPU GEMM's blocking follows the row count)."""
    got, want = _proposals_on_both_widths(drafter, PLAN_MIXES[mix])
    for name in ("tokens", "parents", "depths", "ancestor_mask", "num_nodes"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    torch.testing.assert_close(got.draft_probs, want.draft_probs, rtol=1e-5, atol=1e-6)


def graphed_and_eager(
    dtype: torch.dtype, num_layers: int = 1, quantization: Quantization = "none"
) -> tuple[Drafter, Drafter]:
    head = load_head(torch.device("cuda"), dtype, num_layers)
    return Drafter(head, cuda_graphs=True, quantization=quantization), Drafter(head, False, quantization)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype, num_layers, quantization",
    [(dtype, layers, "none") for dtype in (torch.float32, torch.bfloat16) for layers in (1, 2)]
    + [(torch.bfloat16, 1, "int8"), (torch.bfloat16, 2, "int8")],
)
def test_graph_replays_equal_the_eager_proposal(dtype, num_layers, quantization):
    """Each shape recorded once and replayed, proposal after proposal, as contexts grow, plans change and
    batches shrink to padded buckets, gives the eager run's trees and device trees (int8 matmuls too)."""
    graphed, eager = graphed_and_eager(dtype, num_layers, quantization)
    pairs = [start_sessions(d, CONTEXT_LENGTHS, None, 0) + start_sessions(d, CONTEXT_LENGTHS, SALIENCE, 1)
             for d in (graphed, eager)]  # fmt: skip
    names, generator = list(POLICIES), torch.Generator(device="cuda").manual_seed(0)
    for round_ in range(3):
        for offset in range(len(names)):
            shapes = [POLICIES[names[(offset + i) % len(names)]] for i in range(len(pairs[0]))]
            if offset % 2:
                shapes = [POLICIES[names[offset]]] * len(shapes)  # a lone policy's shape
            picked = slice(0, 3) if offset % 3 == 0 else slice(None)  # 3 sessions pad to a batch of 4
            trees = [
                d.propose_pending([ProposalRequest(s, *p) for s, p in zip(sessions[picked], shapes)])
                for d, sessions in zip((graphed, eager), pairs)
            ]
            for got_pending, want_pending in zip(*trees):
                got, want = got_pending.tree(), want_pending.tree()
                assert got.tokens.tolist() == want.tokens.tolist() and got.parents.tolist() == want.parents.tolist()
                torch.testing.assert_close(got.draft_probs, want.draft_probs)
                assert got_pending.on_device.tokens.device.type == "cuda"
                assert torch.equal(got_pending.on_device.ancestor_mask, want_pending.on_device.ancestor_mask)
        hidden = graphed.head.config.target_hidden_size
        accepted = [torch.randn(round_ + 2, 3 * hidden, device="cuda", generator=generator) for _ in pairs[0]]
        for d, sessions in zip((graphed, eager), pairs):  # the same commits on both: longer contexts, new roots
            for session, features in zip(sessions, accepted):
                d.extend(session, features, list(range(7, 7 + features.shape[0])))
    runs = graphed.proposer._runs.values()
    assert runs and all(run.graph is not None for run in runs)
    assert all(run.graph is None for run in eager.proposer._runs.values())


@pytest.mark.gpu
def test_a_shape_is_recorded_the_first_time_it_comes():
    """The first proposal of a shape records its graph; the next replays it, and both give the same trees."""
    graphed, _ = graphed_and_eager(torch.bfloat16)
    plan, budget = POLICIES["full"]
    sessions = start_sessions(graphed, CONTEXT_LENGTHS, None)
    requests = [ProposalRequest(s, plan, budget) for s in sessions]
    first = graphed.propose_many(requests)
    assert graphed.proposer.num_recorded == 1
    second = graphed.propose_many(requests)
    assert graphed.proposer.num_recorded == 1
    for a, b in zip(first, second):
        assert a.tokens.tolist() == b.tokens.tolist()


@pytest.mark.gpu
def test_two_proposals_of_one_shape_queued_behind_busy_work_grow_their_own_trees():
    """A proposal queued while the device is busy (one queued ahead, behind a verify) leaves its sessions' facts in
    pinned host memory that its copy up reads only when it runs: the next proposal of the same shape, queued
    before that, must not rewrite them under it."""
    graphed, _ = graphed_and_eager(torch.bfloat16)
    plan, budget = POLICIES["full"]
    batches = [
        [ProposalRequest(s, plan, budget) for s in start_sessions(graphed, CONTEXT_LENGTHS, None, seed)]
        for seed in (1, 2)
    ]
    want = [[tree.tokens.tolist() for tree in graphed.propose_many(requests)] for requests in batches]
    assert want[0] != want[1]  # the two batches' roots differ, so their trees do
    torch.cuda.synchronize()
    torch.cuda._sleep(1 << 28)  # the device busy for a while (about 0.1-0.2 s): the copies wait behind it
    pending = [graphed.propose_pending(requests) for requests in batches]
    got = [[tree.tree().tokens.tolist() for tree in trees] for trees in pending]
    assert got == want and graphed.proposer.num_recorded == 1


@pytest.mark.gpu
@pytest.mark.parametrize("num_layers", [1, 2])
def test_the_eager_proposal_never_syncs_the_gpu(num_layers):
    """The eager search (what the graph records) launches work only: CUDA's sync check raises on any host wait."""
    _, eager = graphed_and_eager(torch.bfloat16, num_layers)
    plan, budget = POLICIES["full-threshold"]
    sessions = start_sessions(eager, CONTEXT_LENGTHS, None)
    requests = [ProposalRequest(s, plan, budget) for s in sessions]
    eager.propose_many(requests)  # first use: kernels compile, buffers allocate
    contexts = [s.context for s in sessions]
    lengths = [c.attended_tokens for c in contexts]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():  # as propose_many runs it (the fused kernels serve only without autograd)
            run = eager.proposer._stage(ProposalShape.of(requests, lengths), requests, contexts, lengths)
            out = eager.proposer._search(run)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.num_nodes.device.type == "cuda" and math.isfinite(float(out.draft_probs.sum()))


@pytest.mark.gpu
@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("salience", [None, SALIENCE], ids=["full-context", "salience"])
def test_a_batch_accept_never_waits_for_the_gpu(salience, num_layers):
    """Extending a batch uploads its inputs through pinned memory; the salience scores' copy is queued for
    the next accept (a deeper head's lower layers attend without a wait)."""
    _, eager = graphed_and_eager(torch.bfloat16, num_layers)
    sessions = start_sessions(eager, CONTEXT_LENGTHS, salience)
    c, device = eager.head.config, eager.head.fc.weight.device
    generator = torch.Generator().manual_seed(5)
    extensions = [
        Extension(s, torch.randn(n, 3 * c.target_hidden_size, generator=generator).to(device), [1] * n)
        for s, n in zip(sessions, (1, 3, 2, 5))
    ]
    assert host_waits(lambda: eager.extend_many(extensions)) == []


def host_waits(work: Callable[[], object]) -> list[str]:
    """Where ``work`` made the host wait for the GPU: CUDA's sync debug mode warns at each (file:line: message)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            work()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "synchroniz" in str(w.message)]


def test_an_accept_chooses_the_working_set_its_predecessor_scored_and_leaves_nothing_out(drafter):
    """A prompt's working set is chosen at once; an accept's chunks are scored once the next proposal is launched,
    those scores choose the set at the next accept, and meanwhile every entry past the chunks the set was chosen
    among is attended as the tail."""
    session = start_sessions(drafter, (300,), SALIENCE)[0]
    context, size = session.context, SALIENCE.chunk_size
    assert context.selects and context.covered_chunks == context.index.num_chunks == 300 // size
    arena_tokens = context.arenas[0].view()[0].shape[0]
    c = drafter.head.config
    generator = torch.Generator().manual_seed(9)

    def accept(n: int) -> None:
        features = torch.randn(n, 3 * c.target_hidden_size, generator=generator)
        drafter.extend(session, features, torch.randint(0, c.vocab_size, (n,), generator=generator).tolist())

    accept(size)  # completes a full chunk: scored behind the next proposal, and the set stays the prompt's
    assert context.index.num_chunks == 300 // size and context.covered_chunks == 300 // size
    drafter.propose_many([ProposalRequest(session, *POLICIES["full"])])
    assert context.index.num_chunks == 300 // size + 1 and context.covered_chunks == 300 // size
    assert context.attended_tokens == arena_tokens + session.num_entries - context.covered_chunks * size
    assert context.attended_tokens == context.view(0)[0].shape[0]  # counted as the view it attends to holds
    keys = context.committed(0)[0]
    assert torch.equal(context.view(0)[0][arena_tokens:], keys[context.covered_chunks * size :])
    accept(1)  # takes the set the last accept's scores chose
    assert context.covered_chunks == 300 // size + 1


def test_a_context_outgrowing_the_budget_attends_to_everything_until_its_first_set(drafter):
    session = start_sessions(drafter, (70,), SALIENCE)[0]  # 4 full chunks: all fit, nothing is chosen
    context, c = session.context, drafter.head.config
    assert not context.selects and context.attended_tokens == session.num_entries == context.view(0)[0].shape[0]
    generator = torch.Generator().manual_seed(2)
    for n, chosen in ((15, False), (1, True)):
        features = torch.randn(n, 3 * c.target_hidden_size, generator=generator)
        drafter.extend(session, features, [3] * n)
        assert context.selects and (context.covered_chunks > 0) == chosen
        assert context.attended_tokens <= SALIENCE.budget_tokens
    assert context.attended_tokens < session.num_entries == 86  # a strict subset once the set is taken
    assert torch.equal(context.view(0)[0][-6:], context.committed(0)[0][-6:])  # the newest entries are attended


@pytest.mark.parametrize(
    ("salience", "chunk", "counts"),
    [(None, None, (1, 3, 2, 5)), (SALIENCE, None, (1, 3, 2, 5)), (None, 4, (6, 1, 2, 9))],
    ids=["full-context", "salience", "chunked"],  # chunked: sessions end mid-chunk, a chunk holds no session's end
)
def test_one_extension_pass_for_a_batch_equals_one_per_session(drafter, monkeypatch, salience, chunk, counts):
    """The batched accept (one projection, padded last-entry attention, one output pass) commits what
    extending each session alone commits."""
    if chunk is not None:
        monkeypatch.setattr(draft_service.drafter, "EXTEND_CHUNK", chunk)
    together = start_sessions(drafter, CONTEXT_LENGTHS, salience, seed=3)
    alone = start_sessions(drafter, CONTEXT_LENGTHS, salience, seed=3)
    c = drafter.head.config
    generator = torch.Generator().manual_seed(4)
    steps = []
    for n in counts:
        tokens = torch.randint(0, c.vocab_size, (n,), generator=generator).tolist()
        steps.append((torch.randn(n, 3 * c.target_hidden_size, generator=generator), tokens))
    drafter.extend_many([Extension(s, f, t) for s, (f, t) in zip(together, steps)])
    for session, (features, tokens) in zip(alone, steps):
        drafter.extend(session, features, tokens)
    for got, want in zip(together, alone):
        assert (got.num_entries, got.root_token) == (want.num_entries, want.root_token)
        torch.testing.assert_close(root_output(drafter, got), root_output(drafter, want), rtol=1e-5, atol=1e-5)
        got_keys, want_keys = got.context.view(0)[0], want.context.view(0)[0]
        torch.testing.assert_close(got_keys, want_keys)


def test_a_long_chunk_projecting_k_and_v_alone_starts_with_the_kv_and_query_of_the_whole_projection(
    drafter, monkeypatch
):
    """Chunks of 64 rows (one holding the session's last row, one not) project the last layer's k and v alone and
    the kept query apart: the same entries and the same root output as projecting q|k|v for every row."""
    monkeypatch.setattr(draft_service.drafter, "EXTEND_CHUNK", 64)
    c = drafter.head.config
    generator = torch.Generator().manual_seed(9)
    prompt = torch.randint(0, c.vocab_size, (101,), generator=generator).tolist()
    features = torch.randn(100, 3 * c.target_hidden_size, generator=generator)
    monkeypatch.setattr(draft_service.drafter, "KV_ONLY_MIN_ROWS", 10**9)
    whole = drafter.start(prompt[:-1], features, prompt[-1])
    monkeypatch.setattr(draft_service.drafter, "KV_ONLY_MIN_ROWS", 32)  # both chunks (64 and 36 rows) split
    split = drafter.start(prompt[:-1], features, prompt[-1])
    for layer in range(c.num_layers):
        for got, want in zip(split.context.view(layer), whole.context.view(layer)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split.root_query, whole.root_query, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split.root_hidden, whole.root_hidden)
    torch.testing.assert_close(root_output(drafter, split), root_output(drafter, whole), rtol=1e-5, atol=1e-5)


def test_a_prompt_longer_than_an_extension_chunk_starts_like_its_parts(drafter, monkeypatch):
    """A prompt spans several projection chunks, some holding no session's last entry: it starts with the
    same KV and last output as the same prompt fed in one-chunk pieces."""
    monkeypatch.setattr(draft_service.drafter, "EXTEND_CHUNK", 16)
    c = drafter.head.config
    generator = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, c.vocab_size, (61,), generator=generator).tolist()
    features = torch.randn(60, 3 * c.target_hidden_size, generator=generator)
    whole = drafter.start(prompt[:-1], features, prompt[-1])
    pieces = drafter.start(prompt[:10], features[:10], prompt[10])
    for start in range(10, 60, 10):
        drafter.extend(pieces, features[start : start + 10], prompt[start + 1 : start + 11])
    assert (whole.num_entries, whole.root_token) == (pieces.num_entries, pieces.root_token) == (60, prompt[-1])
    torch.testing.assert_close(whole.context.view(0)[0], pieces.context.view(0)[0])
    torch.testing.assert_close(root_output(drafter, whole), root_output(drafter, pieces), rtol=1e-5, atol=1e-5)
