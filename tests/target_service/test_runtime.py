"""Target runtime: Auto generation, chunked prefill, tree verification, KV commit, per-session failures."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

import target_service.acceptance_step
import target_service.runtime
from diffspec.errors import InvalidRequest, KVPoolExhausted
from diffspec.sampling import SamplingParams
from diffspec.settings import DiffSpecSettings
from diffspec.tree import DraftTree
from diffspec_kernels.attention_metadata import AttentionMetadata
from target_service.backend import PrefillWork, SessionOpen, TargetBatch, VerifyStep
from target_service.runtime import TargetRuntime
from tests.conftest import source_prompts

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def runtime(tiny_target_dir) -> TargetRuntime:
    return TargetRuntime(DiffSpecSettings(base_model=tiny_target_dir, num_pages=1024))


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
    for i, text in enumerate(source_prompts(3)):
        prompt = tokenizer(text)["input_ids"][-700:]
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, min_new_tokens=64)
        assert _auto(runtime, f"auto-{i}", prompt, 64) == ref[0, len(prompt) :].tolist()
        runtime.release(f"auto-{i}")
    assert runtime.info().num_free_pages == runtime.info().num_pages


def test_chunked_prefill_features_equal_dense_forward(runtime):
    """Two prompts prefilled together in 300-token chunks, one step per chunk: every row's features
    and the first token equal one dense forward of the whole prompt."""
    gen = torch.Generator().manual_seed(0)
    prompts = {"feat": torch.randint(3, 8192, (777,), generator=gen).tolist(), "short": [0, 5, 6, 7, 8]}
    opens = [SessionOpen(sid, prompt, GREEDY, want_features=True) for sid, prompt in prompts.items()]
    parts: dict[str, list] = {sid: [] for sid in prompts}
    batch = TargetBatch(opens=opens, prefills=[PrefillWork(sid, 300) for sid in prompts])
    while batch.prefills:
        result = runtime.step(batch)
        assert not result.failures
        for sid, part in result.prefills.items():
            parts[sid].append(part)
        batch = TargetBatch(prefills=[PrefillWork(sid, 300) for sid in prompts if parts[sid][-1].first_token is None])
    assert [(p.done_tokens, p.total_tokens) for p in parts["feat"]] == [(300, 777), (600, 777), (777, 777)]
    assert [p.first_token is None for p in parts["feat"]] == [True, True, False] and len(parts["short"]) == 1
    for sid, prompt in prompts.items():
        hidden, features = runtime.model.forward_dense(torch.tensor([prompt]), runtime.feature_layers)
        got = torch.cat([p.features for p in parts[sid]])
        assert got.shape == (len(prompt), 3 * 256)
        assert torch.allclose(got, features[0], atol=1e-4)
        assert parts[sid][-1].first_token == int(runtime.model.logits(hidden[0, -1]).argmax())
        runtime.release(sid)


def test_the_one_session_prefill_runs_prefill_chunk_tokens_a_forward(tiny_target_dir, monkeypatch):
    """``prefill`` (tools, tests) bounds each forward by ``prefill_chunk`` as the engine does, so a long prompt
    never needs one forward's activations over its whole length; features and first token are the dense ones."""
    runtime = TargetRuntime(DiffSpecSettings(base_model=tiny_target_dir, num_pages=128, prefill_chunk=300))
    forwards, forward_paged = [], runtime.model.forward_paged

    def counted(input_ids, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        forwards.append(input_ids.numel())
        return forward_paged(input_ids, *args, **kwargs)

    monkeypatch.setattr(runtime.model, "forward_paged", counted)
    prompt = torch.randint(3, 8192, (777,), generator=torch.Generator().manual_seed(1)).tolist()
    result = runtime.prefill("long", prompt, GREEDY, want_features=True)
    assert forwards == [300, 300, 177]
    hidden, features = runtime.model.forward_dense(torch.tensor([prompt]), runtime.feature_layers)
    assert torch.allclose(result.features, features[0], atol=1e-4)
    assert result.first_token == int(runtime.model.logits(hidden[0, -1]).argmax())


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
    runtime.step(TargetBatch(opens=[SessionOpen("p2", prompt, GREEDY, want_features=False)]))
    assert runtime.sessions["p2"].prefilled == 96  # six full pages shared: only the last 4 tokens are computed
    assert runtime.info().num_free_pages == free_after_one - 1  # only the partial last page is new
    second = runtime.step(TargetBatch(prefills=[PrefillWork("p2", 100)])).prefills["p2"]
    assert (second.done_tokens, second.features) == (100, None)
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


def _nan_for_marked(target_probs):  # noqa: ANN001, ANN202
    """target_probs, but a distribution of NaNs for sampling at the marker temperature 0.5."""

    def probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        out = target_probs(logits, params)
        return torch.full_like(out, float("nan")) if params.temperature == 0.5 else out

    return probs


def test_a_failing_session_leaves_its_batch_untouched(runtime, monkeypatch):
    """A sampling failure at the first token, a bad tree, a bad prompt: each fails its session
    alone (reported, released), and the other sessions of the same steps get their own results."""
    monkeypatch.setattr(target_service.runtime, "target_probs", _nan_for_marked(target_service.runtime.target_probs))
    prompt = torch.randint(3, 8192, (40,), generator=torch.Generator().manual_seed(9)).tolist()
    expected = _auto(runtime, "alone", prompt, 4)
    runtime.release("alone")
    marked = SamplingParams(temperature=0.5, seed=1)
    opens = [
        SessionOpen("ok", prompt, GREEDY, want_features=False),
        SessionOpen("nan", prompt, marked, want_features=False),
        SessionOpen("vocab", [0, 9000], GREEDY, want_features=False),
        SessionOpen("tree", prompt[:20], GREEDY, want_features=False),
    ]
    result = runtime.step(TargetBatch(opens=opens, prefills=[PrefillWork(o.session_id, 64) for o in opens]))
    assert sorted(result.failures) == ["nan", "vocab"] and sorted(result.prefills) == ["ok", "tree"]
    assert "sampling failed" in str(result.failures["nan"]) and "vocabulary" in str(result.failures["vocab"])
    assert result.prefills["ok"].first_token == expected[0]
    assert sorted(runtime.sessions) == ["ok", "tree"] and not runtime.pool.has_sequence("nan")
    bad_root = runtime.pending_token("tree") + 1
    steps = [VerifyStep("ok", DraftTree.root_only(expected[0])), VerifyStep("tree", DraftTree.chain([bad_root, 5]))]
    result = runtime.step(TargetBatch(verifies=steps))
    assert list(result.failures) == ["tree"] and "not the session's last token" in str(result.failures["tree"])
    assert result.verifies["ok"].bonus_token == expected[1]
    assert [runtime.decode("ok").bonus_token for _ in range(2)] == expected[2:]
    runtime.release("ok")
    assert runtime.info().num_free_pages == runtime.info().num_pages and not runtime.sessions


def test_a_failing_acceptance_leaves_the_other_sessions_their_commits(runtime, monkeypatch):
    patched = _nan_for_marked(target_service.acceptance_step.target_probs)
    monkeypatch.setattr(target_service.acceptance_step, "target_probs", patched)  # the first token still samples
    prompt = torch.randint(3, 8192, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    expected = _auto(runtime, "alone", prompt, 3)
    runtime.release("alone")
    runtime.prefill("ok", prompt, GREEDY, want_features=False)
    runtime.prefill("nan", prompt, SamplingParams(temperature=0.5, seed=1), want_features=False)  # first token fine
    steps = [
        VerifyStep("nan", DraftTree.root_only(runtime.pending_token("nan"))),
        VerifyStep("ok", DraftTree.chain([expected[0], expected[1]])),
    ]
    result = runtime.step(TargetBatch(verifies=steps))
    assert list(result.failures) == ["nan"] and "sampling failed" in str(result.failures["nan"])
    assert result.verifies["ok"].accepted_tokens == [expected[1]] and result.verifies["ok"].bonus_token == expected[2]
    assert runtime.committed_length("ok") == len(prompt) + 2 and not runtime.pool.has_sequence("nan")
    runtime.release("ok")
    assert runtime.info().num_free_pages == runtime.info().num_pages


def test_first_tokens_next_step_reports_the_finished_prompt_when_collected(runtime):
    """With ``first_tokens_next_step`` a finished prompt reports its progress at once and its first token and
    last features in the step that collects it: the same as a step that samples at once."""
    prompt = torch.randint(3, 8192, (70,), generator=torch.Generator().manual_seed(4)).tolist()
    at_once = runtime.prefill("at-once", prompt, GREEDY, want_features=True)
    opened = TargetBatch(opens=[SessionOpen("later", prompt, GREEDY, want_features=True)], first_tokens_next_step=True)
    runtime.step(opened)
    progress = runtime.step(TargetBatch(prefills=[PrefillWork("later", 100)], first_tokens_next_step=True)).prefills
    assert progress["later"].done_tokens == len(prompt) and progress["later"].first_token is None
    assert progress["later"].features is None and runtime.sessions["later"].prefilling
    collected = runtime.step(TargetBatch(collects=["later"])).prefills["later"]
    assert collected.first_token == at_once.first_token and collected.done_tokens == len(prompt)
    assert torch.equal(collected.features, at_once.features)
    assert runtime.decode("later").bonus_token == runtime.decode("at-once").bonus_token
    for sid in ("at-once", "later"):
        runtime.release(sid)


def test_a_collect_without_a_finished_prompt_fails_that_session_alone(runtime):
    prompt = [0, 5, 6, 7, 8, 9]
    opens = [SessionOpen(sid, prompt, GREEDY, want_features=False) for sid in ("done", "running")]
    runtime.step(TargetBatch(opens=opens, prefills=[PrefillWork("done", 6)], first_tokens_next_step=True))
    result = runtime.step(TargetBatch(collects=["done", "running"]))
    assert list(result.prefills) == ["done"] and list(result.failures) == ["running"]
    assert "no finished prompt" in str(result.failures["running"]) and "running" not in runtime.sessions
    runtime.step(TargetBatch(prefills=[PrefillWork("gone", 1)], opens=[SessionOpen("gone", prompt, GREEDY, False)],
                             first_tokens_next_step=True))  # fmt: skip
    runtime.release("gone")  # a released session's finished prompt goes with it
    assert list(runtime.step(TargetBatch(collects=["gone"])).failures) == ["gone"]
    runtime.release("done")
    assert runtime.info().num_free_pages == runtime.info().num_pages
