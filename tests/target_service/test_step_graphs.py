"""Padded step buckets (the shapes CUDA graphs replay) give exactly the unpadded forward's results.

On the CPU the buckets run eagerly (``capture=False``), which checks the padding itself: padded
rows, empty batch slots, fixed-width block tables. The GPU tests replay real CUDA graphs.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from diffspec.sampling import SamplingParams
from diffspec.settings import DiffSpecSettings
from diffspec.errors import InvalidRequest
from diffspec.device_accept import DeviceAccept
from diffspec.tree import DraftTree, PendingTree
from draft_service.options import DraftOptions
from gateway.assembly import build_engine
from gateway.request import GenerationRequest
from target_service.backend import TargetBatch, VerifyStep
from target_service.runtime import TargetRuntime
from target_service.step_graphs import StepGraphs, StepInput, _Bucket
from tests.target_service.trees import pending_tree

GREEDY = SamplingParams()
PROMPTS = {"a": list(range(5, 405)), "b": list(range(900, 1037)), "c": [7, 8, 9] * 60}


def _runtime(tiny_target_dir, **overrides) -> TargetRuntime:
    return TargetRuntime(
        DiffSpecSettings(base_model=tiny_target_dir, device="cpu", num_pages=256, **overrides)
    )


def _padded(runtime: TargetRuntime, batch_sizes: tuple[int, ...], tree_sizes: tuple[int, ...]) -> TargetRuntime:
    runtime.step_graphs = StepGraphs(
        runtime.model, runtime.backend, runtime.cache, runtime.max_context, batch_sizes, tree_sizes,
        runtime.feature_layers, capture=False,
    )  # fmt: skip
    return runtime


def _tree(root: int, truth: list[int], extra: int, seed: int) -> DraftTree:
    """The target's true continuation as a chain, plus ``extra`` random nodes hanging anywhere."""
    chain = DraftTree.chain([root, *truth])
    noise = DraftTree.random(extra + 1, torch.Generator().manual_seed(seed), vocab_size=8192)
    offset = chain.num_nodes - 1
    parents = torch.cat([chain.parents, torch.where(noise.parents[1:] == 0, seed % chain.num_nodes, noise.parents[1:] + offset)])
    tokens = torch.cat([chain.tokens, noise.tokens[1:]])
    return DraftTree(tokens, parents, torch.ones(tokens.numel()))


def _run(
    runtime: TargetRuntime,
    truth: dict[str, list[int]],
    rounds: int,
    device_trees: bool = False,
    sampling: SamplingParams = GREEDY,
) -> list[tuple]:
    """Prefill every prompt, then verify batches of trees of varying size and batch; record every result."""
    seen = []
    for sid, prompt in PROMPTS.items():
        runtime.prefill(sid, prompt, sampling, want_features=True)
    emitted = {sid: 1 for sid in PROMPTS}
    for r in range(rounds):
        batch = list(PROMPTS)[: 1 + r % 3]  # batches of 1, 2, 3 sessions (3 pads to a bucket of 4)
        steps = []
        for i, sid in enumerate(batch):
            good = truth[sid][emitted[sid] : emitted[sid] + 1 + (r + i) % 4]
            tree = _tree(runtime.pending_token(sid), good, extra=(3 * r + i) % 13, seed=r)
            steps.append(VerifyStep(sid, pending_tree(tree, 24, device=runtime.device) if device_trees and i % 2 == 0 else tree))
        handed: dict[str, DeviceAccept] = {}
        results = runtime.step(TargetBatch(verifies=steps, on_verify_queued=handed.update)).verifies
        assert list(results) == [step.session_id for step in steps]
        assert set(handed) == {step.session_id for step in steps if isinstance(step.tree, PendingTree)}
        for sid, accept in handed.items():  # the device's acceptance of a pending tree is the host's
            result, count = results[sid], int(accept.num_entries)
            assert count == len(result.emitted_tokens) and accept.next_tokens[:count].tolist() == result.emitted_tokens
            assert torch.equal(accept.features[:count], result.features)
        for sid, result in results.items():
            emitted[sid] += len(result.accepted_tokens) + 1
            seen.append((result.accepted_tokens, result.accepted_nodes, result.bonus_token, result.features))
    for sid in PROMPTS:
        committed = runtime.pool.num_committed(sid)
        slots = [p * runtime.pool.page_size + o for p in runtime.pool.block_table(sid) for o in range(runtime.pool.page_size)]
        kv = runtime.cache.k_pages.flatten(1, 2)[:, slots[:committed]]
        seen.append((sid, committed, kv))
        runtime.release(sid)
    return seen


def _auto_tokens(runtime: TargetRuntime) -> dict[str, list[int]]:
    """81 greedy tokens per prompt, one Auto decode at a time; every page released after."""
    out = {}
    for sid, prompt in PROMPTS.items():
        tokens = [runtime.prefill(sid, prompt, GREEDY, want_features=False).first_token]
        tokens += [runtime.decode(sid).bonus_token for _ in range(80)]
        runtime.release(sid)
        out[sid] = tokens
    return out


@pytest.fixture(scope="module")
def truth(tiny_target_dir) -> dict[str, list[int]]:
    return _auto_tokens(_runtime(tiny_target_dir))


def _assert_same(got: list[tuple], want: list[tuple]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            if isinstance(a, torch.Tensor):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            else:
                assert a == b


def test_padded_buckets_equal_the_unpadded_forward(tiny_target_dir, truth):
    want = _run(_runtime(tiny_target_dir), truth, rounds=12)
    padded = _padded(_runtime(tiny_target_dir), batch_sizes=(1, 2, 4), tree_sizes=(1, 4, 8, 16))
    got = _run(padded, truth, rounds=12)
    _assert_same(got, want)
    accepted = sum(len(row[0]) for row in want if len(row) == 4)
    assert accepted > 12  # the chains of true tokens were accepted, so commits of long paths were compared


def test_trees_left_on_the_device_verify_as_host_trees(tiny_target_dir, truth):
    """Half the trees are pending (the drafter's device copy, padded to 24 nodes): buckets copy their tokens,
    positions and masks on the device; trees over every bucket read their host nodes. Same results either way."""
    want = _run(_runtime(tiny_target_dir), truth, rounds=12)
    padded = _padded(_runtime(tiny_target_dir), batch_sizes=(1, 2, 4), tree_sizes=(1, 4, 8, 16, 32))
    _assert_same(_run(padded, truth, rounds=12, device_trees=True), want)
    eager = _padded(_runtime(tiny_target_dir), batch_sizes=(1,), tree_sizes=(1, 4))
    _assert_same(_run(eager, truth, rounds=12, device_trees=True), want)


def test_a_sampled_pending_tree_hands_the_host_s_acceptance_on_the_device(tiny_target_dir, truth):
    """Seeded sampling: each pending tree's acceptance computed on the device from its step's outcomes is the one
    the host reads (``_run`` checks them), in buckets and unpadded; and the runs give the same tokens."""
    sampling = SamplingParams(temperature=0.1, seed=3)  # cool enough to follow the greedy chains the trees hold
    want = _run(_runtime(tiny_target_dir), truth, rounds=12, device_trees=True, sampling=sampling)
    padded = _padded(_runtime(tiny_target_dir), batch_sizes=(1, 2, 4), tree_sizes=(1, 4, 8, 16, 32))
    _assert_same(_run(padded, truth, rounds=12, device_trees=True, sampling=sampling), want)
    assert sum(len(row[0]) for row in want if len(row) == 4) > 12  # long sampled paths were accepted


def test_a_bucket_takes_a_pending_tree_from_its_device_copy():
    """What lands in the bucket for a pending tree is its device copy (the host nodes are not read); a host
    tree gets its host mask and positions; rows past a tree see only themselves."""
    host_tree = DraftTree(torch.tensor([5, 6, 7]), torch.tensor([-1, 0, 0]), torch.ones(3))
    marked = torch.ones(4, 4, dtype=torch.bool)  # not an ancestor mask: shows where the bucket read from
    pending = pending_tree(DraftTree.chain([1, 2, 3, 4]), capacity=6, mask=marked)
    pending._host_tree = lambda: pytest.fail("the bucket read the pending tree's host nodes")
    bucket = _Bucket(batch=2, tree=8, max_pages_per_seq=2, page_size=16, device=torch.device("cpu"))
    bucket.fill([StepInput(pending, 3, [0]), StepInput(host_tree, 9, [1])])
    masks, ids, positions = bucket.new_token_mask, bucket.input_ids.view(2, 8), bucket.positions.view(2, 8)
    assert torch.equal(masks[0, :4, :4], marked)
    assert torch.equal(masks[0, 4:, 4:], torch.eye(4, dtype=torch.bool))
    assert ids[0].tolist() == [1, 2, 3, 4, 0, 0, 0, 0] and positions[0].tolist() == [3, 4, 5, 6, 3, 3, 0, 0]
    assert torch.equal(masks[1, :3, :3], host_tree.ancestor_mask())
    assert ids[1, :3].tolist() == [5, 6, 7] and positions[1, :3].tolist() == [9, 10, 10]


def test_a_bucket_s_inputs_go_up_from_one_buffer_and_a_refill_leaves_nothing_of_the_last_step():
    """Ids, positions, committed lengths and masks are views of one buffer (one copy up a step), none over
    another's bytes; a second fill with a smaller step resets every row and table column the first one set."""
    bucket = _Bucket(batch=3, tree=4, max_pages_per_seq=4, page_size=16, device=torch.device("cpu"))
    views = (bucket.input_ids, bucket.positions, bucket.meta.context_lens_t, bucket.meta.new_token_mask)
    assert len({view.untyped_storage().data_ptr() for view in views}) == 1
    spans = sorted((v.storage_offset() * v.element_size(), (v.storage_offset() + v.numel()) * v.element_size())
                   for v in views)  # fmt: skip
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    chain = DraftTree.chain([5, 6, 7, 8])
    bucket.fill([StepInput(chain, 20, [3, 4, 5]), StepInput(chain, 40, [6, 7, 8]), StepInput(chain, 60, [9])])
    assert bucket.meta.context_lens_t.tolist() == [20, 40, 60]
    assert bucket.positions.view(3, 4)[2].tolist() == [60, 61, 62, 63]
    assert bucket.meta.block_tables[:, :3].tolist() == [[3, 4, 5], [6, 7, 8], [9, 0, 0]]
    bucket.fill([StepInput(DraftTree.chain([9]), 7, [2])])
    assert bucket.meta.context_lens_t.tolist() == [7, 0, 0]
    assert bucket.input_ids.view(3, 4).tolist() == [[9, 0, 0, 0], [0] * 4, [0] * 4]
    assert bucket.positions.view(3, 4).tolist() == [[7, 0, 0, 0], [0] * 4, [0] * 4]
    assert torch.equal(bucket.new_token_mask, torch.eye(4, dtype=torch.bool).expand(3, 4, 4))
    assert bucket.meta.block_tables[:, :1].tolist() == [[2], [0], [0]]


def test_a_pending_tree_with_a_wrong_root_fails_its_session_alone(tiny_target_dir):
    """Its nodes are checked after the forward: that session fails and frees its pages, the other keeps its
    result, equal to the same step without the bad tree."""
    def step(bad_root: bool) -> tuple:
        runtime = _padded(_runtime(tiny_target_dir), batch_sizes=(1, 2), tree_sizes=(1, 8))
        for sid in ("a", "b"):
            runtime.prefill(sid, PROMPTS[sid], GREEDY, want_features=False)
        root = runtime.pending_token("a") + (1 if bad_root else 0)
        steps = [VerifyStep("a", pending_tree(DraftTree.chain([root, 3, 4]), capacity=8))] if bad_root else []
        steps.append(VerifyStep("b", pending_tree(DraftTree.chain([runtime.pending_token("b"), 5]), capacity=8)))
        result = runtime.step(TargetBatch(verifies=steps))
        pages_left = runtime.pool.num_free_pages + len(runtime.pool.block_table("b"))
        return result, runtime.pool.has_sequence("a"), pages_left == runtime.pool.num_pages

    bad, a_held, only_b_holds_pages = step(bad_root=True)
    good, _, _ = step(bad_root=False)
    assert isinstance(bad.failures["a"], InvalidRequest) and "tree root" in str(bad.failures["a"])
    assert not a_held and only_b_holds_pages
    assert bad.verifies["b"] == good.verifies["b"]


def test_steps_beyond_every_bucket_run_unpadded(tiny_target_dir, truth):
    """Trees over the largest bucket (16) fall back to the eager forward with the same results."""
    want = _run(_runtime(tiny_target_dir), truth, rounds=6)
    got = _run(_padded(_runtime(tiny_target_dir), batch_sizes=(1,), tree_sizes=(1, 4)), truth, rounds=6)
    _assert_same(got, want)


@pytest.mark.parametrize(
    "buckets, want_rows",
    [(None, 3 + 6), (((1, 2, 4), (1, 4, 8, 16)), 2 * 8), (((1,), (1, 4)), 3 + 6)],
    ids=["eager", "bucket (2, 8)", "past every bucket"],
)
def test_a_verify_reports_the_rows_its_forward_computed(tiny_target_dir, buckets, want_rows):
    """Trees of 3 and 6 nodes: the eager forward computes their 9 rows; a (2, 8) bucket 16, padding included."""
    runtime = _runtime(tiny_target_dir)
    if buckets is not None:
        runtime = _padded(runtime, *buckets)
    for sid in ("a", "b"):
        runtime.prefill(sid, PROMPTS[sid], GREEDY, want_features=False)
    steps = [VerifyStep(sid, DraftTree.chain([runtime.pending_token(sid), *range(10, 9 + n)]))
             for sid, n in (("a", 3), ("b", 6))]  # fmt: skip
    result = runtime.step(TargetBatch(verifies=steps))
    assert len(result.verifies) == 2 and result.verify_rows == want_rows
    assert runtime.step(TargetBatch()).verify_rows is None  # nothing verified


def test_auto_decode_through_buckets_equals_eager(tiny_target_dir, truth):
    runtime = _padded(_runtime(tiny_target_dir), batch_sizes=(1,), tree_sizes=(1,))
    assert _auto_tokens(runtime) == truth
    assert runtime.pool.num_free_pages == runtime.pool.num_pages


# -- GPU: real CUDA graphs -------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_graph_replays_equal_eager_steps(tiny_target_dir):
    common = dict(base_model=tiny_target_dir, device="cuda", dtype="float32", attention_backend="triton",
                  num_pages=256, graph_batch_sizes="1,2,4", graph_tree_sizes="1,4,8,16")  # fmt: skip
    eager = TargetRuntime(DiffSpecSettings(cuda_graphs=False, **common))
    truth = _auto_tokens(eager)
    graphed = TargetRuntime(DiffSpecSettings(cuda_graphs=True, **common))
    want = _run(eager, truth, rounds=12)
    got = _run(graphed, truth, rounds=12)
    assert graphed.step_graphs is not None and graphed.step_graphs.num_recorded >= 4
    _assert_same(got, want)
    # pending trees on the GPU: the replays read them in place and hand their acceptance on the device (``_run``
    # checks it against the host's)
    _assert_same(_run(graphed, truth, rounds=12, device_trees=True), want)
    # and a sampled session's, from its step's outcomes
    _run(graphed, truth, rounds=12, device_trees=True, sampling=SamplingParams(temperature=0.1, seed=3))
    assert graphed.pool.num_free_pages == graphed.pool.num_pages


@pytest.mark.gpu
def test_warm_up_times_every_bucket(tiny_target_dir):
    settings = DiffSpecSettings(base_model=tiny_target_dir, device="cuda", num_pages=256,
                                graph_batch_sizes="1,2,4", graph_tree_sizes="1,4,8")  # fmt: skip
    runtime = TargetRuntime(settings)
    assert runtime.verify_costs() == {}  # nothing timed before the warm-up
    runtime.warm_up()
    costs = runtime.verify_costs()
    assert sorted(costs) == [(b, t) for b in (1, 2, 4) for t in (1, 4, 8)]
    assert all(0.0 < seconds < 1.0 for seconds in costs.values())


@pytest.mark.gpu
def test_concurrent_speculative_streams_with_graphs_equal_auto(tiny_target_dir):
    """Eight streams at once through the engine loop: verify batches of several sessions replay padded buckets."""
    settings = DiffSpecSettings(base_model=tiny_target_dir, device="cuda", dtype="float32", num_pages=1024)
    engine = build_engine(settings)
    prompts = [list(range(5 + 40 * i, 300 + 40 * i)) for i in range(8)]

    async def one(ids: list[int], options: DraftOptions | None) -> list[int]:
        tokens = []
        async for chunk in engine.generate(GenerationRequest(ids, 64, draft=options)):
            tokens += chunk.token_ids
        return tokens

    async def all_streams(options: DraftOptions | None) -> list[list[int]]:
        return await asyncio.gather(*(one(ids, options) for ids in prompts))

    try:
        auto = [asyncio.run(one(ids, None)) for ids in prompts]  # one at a time: batch-1 buckets only
        assert asyncio.run(all_streams(DraftOptions("full"))) == auto
    finally:
        engine.close()
