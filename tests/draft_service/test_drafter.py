"""Draft trees from the shipped head: policy shapes, batched proposals, budgets."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from diffspec.sampling import SamplingParams
from diffspec.settings import BUNDLED_DRAFT, DiffSpecSettings
from draft_service.backend import DraftOptions
from draft_service.eagle3_head import Eagle3Head
from draft_service.depth_graphs import DepthGraphs
from draft_service.head_graphs import HeadGraphs, top_candidates
from draft_service.runtime import DraftRuntime
from target_service.runtime import TargetRuntime

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):\n        self.items = []", "import os\nimport re"]


@pytest.fixture(scope="module")
def started(tiny_target_dir):
    target = TargetRuntime(DiffSpecSettings(base_model=tiny_target_dir, num_pages=256))
    head = Eagle3Head.load(BUNDLED_DRAFT, target.model.embed_tokens, torch.device("cpu"), torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)

    def start(runtime: DraftRuntime, options: DraftOptions) -> list[str]:
        ids = []
        for i, text in enumerate(PROMPTS):
            prompt = tokenizer(text)["input_ids"]
            sid = f"{options.policy}-{options.salience}-{i}-{id(runtime)}"
            pre = target.prefill(sid, prompt, SamplingParams(), want_features=True)
            runtime.start(sid, prompt, pre.features, pre.first_token, options)
            target.release(sid)
            ids.append(sid)
        return ids

    return head, start


@pytest.mark.parametrize(
    "options, max_nodes, max_depth",
    [
        (DraftOptions("chain", "64:0.0:6"), 7, 6),
        (DraftOptions("uniform2", "15:0.0:3"), 15, 3),
        (DraftOptions("full", "40:0.0:5"), 40, 5),
        (DraftOptions("full", "40:0.5:5"), 40, 5),
        (DraftOptions("online", "32:0.0:6"), 32, 6),
    ],
)
def test_trees_respect_their_budget(started, options, max_nodes, max_depth):
    head, start = started
    runtime = DraftRuntime(head)
    for sid in start(runtime, options):
        tree = runtime.propose(sid)
        assert 1 <= tree.num_nodes <= max_nodes and int(tree.depths().max()) <= max_depth
        if options.policy == "chain":
            assert tree.parents.tolist() == list(range(-1, tree.num_nodes - 1))
        if options.tree_config.split(":")[1] == "0.5":  # every kept node is at least 50% likely
            cumulative = torch.ones(tree.num_nodes)
            for i in range(1, tree.num_nodes):
                cumulative[i] = cumulative[int(tree.parents[i])] * tree.draft_probs[i]
            assert bool((cumulative[1:] >= 0.5 - 1e-6).all())


@pytest.mark.parametrize("salience", [False, True])
def test_batched_proposals_equal_one_at_a_time(started, salience):
    head, start = started
    options = DraftOptions("full", "32:0.0:5", salience=salience)
    alone, together = DraftRuntime(head), DraftRuntime(head)
    singles = [alone.propose(sid) for sid in start(alone, options)]
    batched = together.propose_batch(start(together, options))
    for one, many in zip(singles, batched):
        assert torch.equal(one.tokens, many.tokens) and torch.equal(one.parents, many.parents)
        assert torch.allclose(one.draft_probs, many.draft_probs, atol=1e-5)


@pytest.mark.parametrize("options", [DraftOptions("full", "64:0.0:8"), DraftOptions("uniform3", "40:0.0:4", salience=True)])
def test_padded_head_buckets_give_the_same_trees(started, options):
    """The bucketed dense halves (what CUDA graphs replay; eager here) change no tree."""
    head, start = started
    plain, padded = DraftRuntime(head), DraftRuntime(head)
    padded.drafter.graphs = HeadGraphs(head, padded.drafter.fused, capture=False)
    want = plain.propose_batch(start(plain, options))
    got = padded.propose_batch(start(padded, options))
    assert padded.drafter.graphs._pre and padded.drafter.graphs._post  # the buckets ran
    for one, other in zip(want, got):
        assert torch.equal(one.tokens, other.tokens) and torch.equal(one.parents, other.parents)
        assert torch.allclose(one.draft_probs, other.draft_probs, atol=1e-6)


@pytest.mark.gpu
def test_head_graph_replays_match_the_eager_head():
    """Each recorded half, replayed with new rows of several sizes, gives the eager head's numbers."""
    target = TargetRuntime(DiffSpecSettings(device="cuda", dtype="float32", num_pages=64))
    head = Eagle3Head.load(BUNDLED_DRAFT, target.model.embed_tokens, torch.device("cuda"), torch.float32)
    fused = head.fused_projections()
    graphs = HeadGraphs(head, fused, capture=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    c = head.config
    with torch.no_grad():
        for rows in (3, 1, 16, 5, 3):  # repeats replay a recorded bucket with new inputs
            tokens = torch.randint(0, 4096, (rows,), device="cuda", generator=gen)
            hidden = torch.randn(rows, c.hidden_size, device="cuda", generator=gen)
            positions = torch.randint(0, 2048, (rows,), device="cuda", generator=gen)
            for got, want in zip(graphs.attention_inputs(tokens, hidden, positions),
                                 head.attention_inputs(tokens, hidden, positions, fused)):  # fmt: skip
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            attn = torch.randn(rows, c.num_heads, c.head_dim, device="cuda", generator=gen)
            outputs, top = graphs.outputs_and_top(attn, hidden, 10)
            want_outputs = head.attention_outputs(attn, hidden, fused)
            torch.testing.assert_close(outputs, want_outputs, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(top[0], top_candidates(head, want_outputs, 10)[0], rtol=1e-4, atol=1e-4)
    assert all(half.graph is not None for half in [*graphs._pre.values(), *graphs._post.values()])


@pytest.mark.parametrize(
    "options",
    [DraftOptions("full", "64:0.0:8"), DraftOptions("full", "48:0.0:6", salience=True), DraftOptions("chain", "8:0.0:7")],
)
def test_whole_depth_buckets_give_the_same_trees(started, options):
    """One session's depths over the static context and tree buffers (eager here) change no tree,
    proposal after proposal (the buffers are reused with another context each time)."""
    head, start = started
    plain, staged = DraftRuntime(head), DraftRuntime(head)
    staged.drafter.depth_graphs = DepthGraphs(head, staged.drafter.fused, capture=False)
    for want_sid, got_sid in zip(start(plain, options), start(staged, options)):
        want, got = plain.propose(want_sid), staged.propose(got_sid)
        assert torch.equal(want.tokens, got.tokens) and torch.equal(want.parents, got.parents)
        assert torch.allclose(want.draft_probs, got.draft_probs, atol=1e-6)
    assert staged.drafter.depth_graphs._recorded  # the staged path ran


@pytest.mark.gpu
def test_depth_graph_replays_equal_their_eager_buckets(tiny_target_dir):
    """Recorded depths replayed across proposals and contexts give the trees of the same buckets run eagerly."""
    target = TargetRuntime(DiffSpecSettings(base_model=tiny_target_dir, device="cuda", dtype="float32", num_pages=256))
    head = Eagle3Head.load(BUNDLED_DRAFT, target.model.embed_tokens, torch.device("cuda"), torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    graphed, eager = DraftRuntime(head), DraftRuntime(head)
    eager.drafter.depth_graphs = DepthGraphs(head, eager.drafter.fused, capture=False)
    for options in (DraftOptions("full", "64:0.0:8"), DraftOptions("full", "48:0.0:6", salience=True)):
        for i, text in enumerate(PROMPTS):
            prompt = tokenizer(text)["input_ids"]
            pre = target.prefill(f"p{i}", prompt, SamplingParams(), want_features=True)
            target.release(f"p{i}")
            for runtime in (graphed, eager):
                runtime.start(f"{options}-{i}", prompt, pre.features, pre.first_token, options)
            want, got = eager.propose(f"{options}-{i}"), graphed.propose(f"{options}-{i}")
            assert torch.equal(want.tokens, got.tokens) and torch.equal(want.parents, got.parents)
    assert all(r.graph is not None for r in graphed.drafter.depth_graphs._recorded.values())
