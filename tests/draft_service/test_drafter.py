"""Draft trees from the shipped head: policy shapes, batched proposals, budgets."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from diffspec.sampling import SamplingParams
from diffspec.settings import BUNDLED_DRAFT, DiffSpecSettings
from draft_service.backend import DraftOptions
from draft_service.eagle3_head import Eagle3Head
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
