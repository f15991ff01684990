"""Target runtime: Auto generation, chunked prefill, tree verification and KV commit."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from diffspec.errors import InvalidRequest, KVPoolExhausted
from diffspec.sampling import SamplingParams
from diffspec.settings import DiffSpecSettings
from diffspec.tree import DraftTree
from kernels.attention_metadata import AttentionMetadata
from target_service.runtime import TargetRuntime
from tests.conftest import short_prompts

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def runtime(tiny_target_dir) -> TargetRuntime:
    return TargetRuntime(DiffSpecSettings(base_model=tiny_target_dir, num_pages=1024, prefill_chunk=300))


@pytest.fixture(scope="module")
def hf_model(tiny_target_dir):
    return LlamaForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()


def _auto(runtime: TargetRuntime, sid: str, prompt: list[int], n: int) -> list[int]:
    out = [runtime.prefill(sid, prompt, GREEDY, want_features=False).first_token]
    while len(out) < n:
        out.append(runtime.decode(sid).bonus_token)
    return out


def test_auto_greedy_equals_transformers_generate(runtime, hf_model, tiny_target_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    for i, text in enumerate(short_prompts(3)):
        prompt = tokenizer(text)["input_ids"][-700:]
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, min_new_tokens=64)
        assert _auto(runtime, f"auto-{i}", prompt, 64) == ref[0, len(prompt) :].tolist()
        runtime.release(f"auto-{i}")
    assert runtime.info().num_free_pages == runtime.info().num_pages


def test_chunked_prefill_features_equal_dense_forward(runtime):
    prompt = torch.randint(3, 8192, (777,), generator=torch.Generator().manual_seed(0)).tolist()
    result = runtime.prefill("feat", prompt, GREEDY, want_features=True)
    hidden, features = runtime.model.forward_dense(torch.tensor([prompt]), runtime.feature_layers)
    assert result.features.shape == (777, 3 * 256)
    assert torch.allclose(result.features, features[0], atol=1e-4)
    assert result.first_token == int(runtime.model.logits(hidden[0, -1]).argmax())
    runtime.release("feat")


@pytest.mark.parametrize("num_nodes, seed", [(1, 0), (9, 1), (40, 2)])
def test_tree_logits_equal_sequential_path_decoding(runtime, num_nodes, seed):
    prompt = torch.randint(3, 8192, (53,), generator=torch.Generator().manual_seed(seed)).tolist()
    sid = f"tree-{seed}"
    first = runtime.prefill(sid, prompt, GREEDY, want_features=False).first_token
    tree = DraftTree.random(num_nodes, torch.Generator().manual_seed(seed), vocab_size=8192, root=first)
    ctx = runtime.committed_length(sid)
    meta = AttentionMetadata.build(
        [num_nodes], [ctx], [runtime.pool.block_table(sid)], [tree.ancestor_mask()], runtime.pool.page_size, runtime.device
    )
    out = runtime.model.forward_paged(
        tree.tokens, tree.depths() + ctx, runtime.cache.k_pages, runtime.cache.v_pages, meta, runtime.backend
    )
    tree_logits = runtime.model.logits(out.hidden)
    for node in range(num_nodes):
        path_tokens = tree.tokens[tree.path_to(node)].tolist()
        hidden, _ = runtime.model.forward_dense(torch.tensor([prompt + path_tokens]))
        expected = runtime.model.logits(hidden[0, -1])
        assert (tree_logits[node] - expected).abs().max() <= 1e-4, f"node {node}"
    runtime.release(sid)


def test_committed_kv_equals_plain_decoding(runtime):
    prompt = torch.randint(3, 8192, (45,), generator=torch.Generator().manual_seed(7)).tolist()
    expected = _auto(runtime, "plain", prompt, 7)  # first token + 6 decoded
    first = runtime.prefill("spec", prompt, GREEDY, want_features=True).first_token
    assert first == expected[0]
    # the greedy chain buried among distractor branches: node 1 and 3 are wrong siblings
    tokens = [first, (expected[1] + 1) % 8192, expected[1], (expected[2] + 5) % 8192, expected[2], expected[3]]
    tree = DraftTree(torch.tensor(tokens), torch.tensor([-1, 0, 0, 2, 2, 4]), torch.ones(6))
    result = runtime.verify("spec", tree)
    assert result.accepted_tokens == expected[1:4] and result.accepted_nodes == [2, 4, 5]
    assert result.bonus_token == expected[4] and result.features.shape == (4, 768)
    assert runtime.committed_length("spec") == runtime.committed_length("plain") - 2
    n = runtime.committed_length("spec")
    for sid_pages in ("spec", "plain"):
        assert runtime.pool.committed_token_ids(sid_pages)[:n] == runtime.pool.committed_token_ids("spec")
    k_flat = runtime.cache.k_pages.flatten(1, 2)
    v_flat = runtime.cache.v_pages.flatten(1, 2)
    assert torch.allclose(k_flat[:, _slots(runtime, "spec", n)], k_flat[:, _slots(runtime, "plain", n)], atol=1e-5)
    assert torch.allclose(v_flat[:, _slots(runtime, "spec", n)], v_flat[:, _slots(runtime, "plain", n)], atol=1e-5)
    runtime.release("spec")
    runtime.release("plain")


def _slots(runtime: TargetRuntime, sid: str, n: int) -> torch.Tensor:
    """Flat page slots of a session's first n positions."""
    table, size = runtime.pool.block_table(sid), runtime.pool.page_size
    return torch.tensor([table[p // size] * size + p % size for p in range(n)])


def test_shared_prefix_pages_are_reused(runtime):
    prompt = torch.randint(3, 8192, (100,), generator=torch.Generator().manual_seed(3)).tolist()
    first = _auto(runtime, "p1", prompt, 10)
    free_after_one = runtime.info().num_free_pages
    second = runtime.prefill("p2", prompt, GREEDY, want_features=False)
    assert second.num_cached_tokens == 96
    assert runtime.info().num_free_pages == free_after_one - 1  # only the partial last page is new
    assert [second.first_token] + [runtime.decode("p2").bonus_token for _ in range(9)] == first
    runtime.release("p1")
    runtime.release("p2")
    assert runtime.info().num_free_pages == runtime.info().num_pages


@pytest.mark.parametrize(
    "prompt, message",
    [([], "empty"), ([5, 9000], "out of the vocabulary"), ([5] * 20000, "does not fit the context")],
)
def test_bad_prompts_are_rejected(runtime, prompt, message):
    with pytest.raises(InvalidRequest, match=message):
        runtime.prefill("bad", prompt, GREEDY, want_features=False)
    assert not runtime.pool.has_sequence("bad")


def test_bad_trees_are_rejected(runtime):
    first = runtime.prefill("t", [0, 5, 6, 7], GREEDY, want_features=False).first_token
    with pytest.raises(InvalidRequest, match="not the session's last token"):
        runtime.verify("t", DraftTree.chain([first + 1, 5]))
    with pytest.raises(InvalidRequest, match="unknown session"):
        runtime.verify("nope", DraftTree.chain([first]))
    runtime.release("t")


def test_pool_exhaustion_is_typed_and_leaks_nothing(tiny_target_dir):
    small = TargetRuntime(DiffSpecSettings(base_model=tiny_target_dir, num_pages=4, page_size=16))
    with pytest.raises(KVPoolExhausted):
        small.prefill("big", list(range(3, 100)), GREEDY, want_features=False)
    assert small.info().num_free_pages == 4 and not small.sessions
