"""Speculative sampling with real draft trees keeps the target's distribution (temperature > 0)."""

from __future__ import annotations

import pytest
import torch

from diffspec.tree import DraftTree
from scipy.stats import chisquare
from transformers import AutoTokenizer

from diffspec.sampling import SamplingParams, target_probs
from diffspec.settings import BUNDLED_DRAFT, DiffSpecSettings
from draft_service.backend import DraftBatch, DraftStart
from draft_service.eagle3_head import Eagle3Head
from draft_service.options import DraftOptions
from draft_service.runtime import DraftRuntime
from tests.diffspec.test_acceptance import accept_sampled, fresh
from diffspec_kernels.attention_metadata import AttentionMetadata
from target_service.runtime import TargetRuntime

TRIALS = 4000


@pytest.fixture(scope="module")
def runtimes(tiny_target_dir):
    target = TargetRuntime(DiffSpecSettings(base_model=tiny_target_dir, num_pages=256))
    head = Eagle3Head.load(BUNDLED_DRAFT, target.model.embed_tokens, torch.device("cpu"), torch.float32)
    return target, DraftRuntime(head), AutoTokenizer.from_pretrained(tiny_target_dir)


@pytest.mark.parametrize(
    ("policy", "top_k"), [("chain", 0), ("uniform4", 0), ("full", 0), ("online", 0), ("full", 6), ("chain", 3)]
)
def test_first_emitted_token_follows_the_target(runtimes, policy, top_k):
    """With top_k, the drafts (the draft's own top candidates) fall outside the kept set as often as not."""
    target, draft, tokenizer = runtimes
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7, top_k=top_k)
    policy = f"{policy}-k{top_k}"  # the session id
    prompt = tokenizer("def parse_args(argv):\n    parser = argparse.ArgumentParser(")["input_ids"]
    pre = target.prefill(policy, prompt, params, want_features=True)
    start = DraftStart(policy, prompt, pre.features, pre.first_token, DraftOptions(policy.split("-")[0], "24:0.0:4"))
    tree = DraftTree.of(draft.step(DraftBatch(starts=[start], proposes=[policy])).trees[policy])
    assert tree.num_nodes > 1
    # the target's distribution at every tree node, from one tree forward over the prompt's pages
    ctx = target.committed_length(policy)
    meta = AttentionMetadata.build(
        [tree.num_nodes], [ctx], [target.pool.block_table(policy)], [tree.ancestor_mask()], 16, target.device
    )
    out = target.model.forward_paged(
        tree.tokens, tree.depths() + ctx, target.cache.k_pages, target.cache.v_pages, meta, target.backend
    )
    probs = target_probs(target.model.logits(out.hidden), params)
    counts = torch.zeros(probs.shape[1])
    generator = params.generator()
    for _ in range(TRIALS):
        result = accept_sampled(tree, probs, fresh(generator))
        first = int(tree.tokens[result.accepted_nodes[0]]) if result.accepted_nodes else result.bonus_token
        counts[first] += 1
    p = probs[0]
    assert counts[p == 0].sum() == 0, "a token outside the top-k / top-p set was emitted"
    if top_k:
        assert int((p > 0).sum()) <= top_k
    frequent = p * TRIALS >= 5  # chi-square needs expected counts of 5+; the rest is pooled
    observed = torch.cat([counts[frequent], counts[~frequent].sum().view(1)])
    expected = torch.cat([p[frequent], p[~frequent].sum().view(1)]) * TRIALS
    keep = expected > 0  # no pooled bin when every token is frequent
    assert chisquare(observed[keep].numpy(), expected[keep].numpy()).pvalue > 1e-3
    target.release(policy)
    assert policy in draft.step(DraftBatch(releases=[policy])).released
