"""EAGLE-3 trainer: the TTT attention mask and token shifts, corpus reading, training, resuming."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from diffspec.errors import InvalidRequest
from draft_service.eagle3_head import Eagle3Head
from draft_service.train_config import TrainConfig
from draft_service.train_corpus import corpus_files, tokenize_corpus
from draft_service.trainer import STATE_FILE, TrainSummary, train_draft
from draft_service.ttt_unroll import ttt_attention, ttt_forward
from target_service.llama import LlamaModel
from tests.draft_service.test_eagle3_head import HIDDEN, VOCAB, random_head

TEMPLATE = '''
class {name}Store:
    """Keeps {name} records by key."""

    def __init__(self, capacity: int = {n}) -> None:
        self.capacity = capacity
        self.items: dict[str, int] = {{}}

    def add_{name}(self, key: str, value: int) -> None:
        if len(self.items) >= self.capacity:
            raise ValueError("{name} store is full")
        self.items[key] = value + {n}

    def total(self) -> int:
        return sum(value for value in self.items.values())
'''


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These runs are tiny: one thread is as fast as two and does not thrash when the machine is busy (module
    scope: the shared training run is set up under it too)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A few small Python modules, plus files the corpus rules must skip."""
    root = tmp_path_factory.mktemp("corpus")
    names = ["user", "order", "invoice", "session", "token", "ledger", "cache", "queue", "report", "window"]
    for i in range(6):
        (root / "pkg").mkdir(exist_ok=True)
        text = "".join(TEMPLATE.format(name=name, n=i * 10 + j) for j, name in enumerate(names))
        (root / "pkg" / f"module_{i}.py").write_text(text)
    (root / "site-packages").mkdir()
    (root / "site-packages" / "vendored.py").write_text("import vendored\n")
    (root / "pkg" / "notes.md").write_text("not code\n")
    (root / "rows.jsonl").write_text(json.dumps({"text": "def first():\n    return 1\n"}) + "\n"
                                     + json.dumps({"text": "def second():\n    return 2\n"}) + "\n")
    return root


def test_ttt_attention_matches_explicit_mask() -> None:
    """Position t sees step-0 keys 0..t plus its own keys of the later steps, nothing else."""
    gen = torch.Generator().manual_seed(0)
    batch, length, heads, kv_heads, dim, steps = 2, 6, 4, 2, 8, 2
    q = torch.randn(batch, length, heads, dim, generator=gen)
    k0, v0 = (torch.randn(batch, length, kv_heads, dim, generator=gen) for _ in range(2))
    diag_k, diag_v = (torch.randn(batch, length, steps, kv_heads, dim, generator=gen) for _ in range(2))
    out = ttt_attention(q, k0, v0, diag_k, diag_v, dim**-0.5)
    for b in range(batch):
        for t in range(length):
            for h in range(heads):
                kv = h // (heads // kv_heads)
                keys = torch.cat([k0[b, : t + 1, kv], diag_k[b, t, :, kv]])
                values = torch.cat([v0[b, : t + 1, kv], diag_v[b, t, :, kv]])
                expected = torch.softmax(keys @ q[b, t, h] * dim**-0.5, dim=0) @ values
                torch.testing.assert_close(out[b, t, h], expected, rtol=1e-5, atol=1e-5)


def test_ttt_forward_refuses_a_head_of_two_layers() -> None:
    head = random_head(num_layers=2)
    token_ids, features = torch.zeros(1, 5, dtype=torch.long), torch.zeros(1, 5, 3 * HIDDEN)
    with pytest.raises(InvalidRequest, match="one-layer heads; this head has 2 layers"):
        ttt_forward(head, token_ids, features, ttt_steps=2)


def test_ttt_forward_pairs_and_shifts_like_inference() -> None:
    """Step 0 == forward_dense on (feature t, token t+1); step 1 reads token t+2 at position t+1."""
    head = random_head()
    gen = torch.Generator().manual_seed(3)
    seq = 7
    token_ids = torch.randint(0, VOCAB, (1, seq), generator=gen)
    features = torch.randn(1, seq, 3 * HIDDEN, generator=gen)
    with torch.no_grad():
        outputs = ttt_forward(head, token_ids, features, ttt_steps=3)
        step0 = head.forward_dense(token_ids[:, 1:], head.fuse(features[:, :-1]), torch.arange(seq - 1)[None])
        q, k, v = head.attention_inputs(token_ids[0, 2:], outputs[0][0, : seq - 2], head.rope(torch.arange(1, seq - 1)))
        k0, v0 = head.attention_inputs(token_ids[0, 1:], head.fuse(features[0, :-1]), head.rope(torch.arange(seq - 1)))[1:]
    assert [tuple(o.shape) for o in outputs] == [(1, 6, HIDDEN), (1, 5, HIDDEN), (1, 4, HIDDEN)]
    torch.testing.assert_close(outputs[0], step0, rtol=1e-5, atol=1e-5)
    group = head.config.num_heads // head.config.num_kv_heads
    for t in range(seq - 2):
        keys = torch.cat([k0[: t + 1], k[t : t + 1]]).repeat_interleave(group, dim=1)  # [t+2, heads, hd]
        values = torch.cat([v0[: t + 1], v[t : t + 1]]).repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,khd->hk", q[t], keys) * head.scale, dim=-1)
        attn = torch.einsum("hk,khd->hd", weights, values)
        expected = head.attention_outputs(attn[None], outputs[0][0, t : t + 1])
        torch.testing.assert_close(outputs[1][0, t : t + 1], expected, rtol=1e-5, atol=1e-5)


def test_corpus_files_and_tokens(corpus_dir: Path, tiny_target_dir: Path) -> None:
    files = corpus_files([corpus_dir / "pkg", corpus_dir / "site-packages", corpus_dir / "rows.jsonl"],
                         exclude=["site-packages"], max_files=0)
    assert [f.name for f in files] == [f"module_{i}.py" for i in range(6)] + ["rows.jsonl"]
    assert len(corpus_files([corpus_dir], exclude=["*/site-packages/*"], max_files=3)) == 3
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    config = TrainConfig(corpus=[corpus_dir / "rows.jsonl"], seq_len=4, ttt_steps=1)
    corpus = tokenize_corpus(config, tokenizer, vocab_size=8192, eos_id=1)
    docs = [tokenizer("def first():\n    return 1\n", add_special_tokens=False)["input_ids"],
            tokenizer("def second():\n    return 2\n", add_special_tokens=False)["input_ids"]]
    stream = docs[0] + [1] + docs[1] + [1]
    assert corpus.windows.flatten().tolist() == stream[: len(stream) // 4 * 4]
    assert int(corpus.token_counts.sum()) == len(stream) and int(corpus.token_counts[1]) == 2
    with pytest.raises(InvalidRequest, match="need >= seq_len"):
        tokenize_corpus(config.model_copy(update={"seq_len": 500}), tokenizer, vocab_size=8192, eos_id=1)


def _config(corpus_dir: Path, out_dir: Path, **overrides) -> TrainConfig:
    values = dict(corpus=[corpus_dir], exclude=["site-packages"], out_dir=out_dir, steps=30, seq_len=64,
                  batch_size=4, lr=2e-3, warmup_steps=3, ttt_steps=3, draft_vocab_size=1024, log_every=1,
                  save_every=100, device="cpu")
    return TrainConfig(**(values | overrides))


@pytest.fixture(scope="module")
def trained(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TrainSummary]:
    """A 30-step run on the tiny target: its out_dir and summary."""
    out_dir = tmp_path_factory.mktemp("trained")
    return out_dir, train_draft(_config(corpus_dir, out_dir))


def test_training_reduces_loss_and_writes_a_loadable_head(
    trained: tuple[Path, TrainSummary], tiny_target_dir: Path
) -> None:
    out_dir, summary = trained
    assert summary.steps == 30 and len(summary.losses) == 30 and len(summary.step_accuracy) == 3
    assert summary.tokens_seen == 30 * 4 * 64
    first, last = sum(summary.losses[:5]) / 5, sum(summary.losses[-5:]) / 5
    assert last < 0.6 * first, summary.losses
    assert summary.step_accuracy[0] > 0.4

    target = LlamaModel.from_pretrained(tiny_target_dir, torch.device("cpu"), torch.float32)
    head = Eagle3Head.load(out_dir, target.embed_tokens, torch.device("cpu"), torch.float32)
    state = torch.load(out_dir / STATE_FILE, weights_only=True)["head"]
    assert state.keys() == head.state_dict().keys()
    for name, tensor in state.items():
        assert torch.equal(head.state_dict()[name], tensor), name
    assert head.config.feature_layers == (1, 2, 3) and head.config.draft_vocab_size == 1024
    assert int(head.t2d.sum()) == 1024 and bool(head.t2d[1])  # eos separates every document: frequent
    report = json.loads((out_dir / "training.json").read_text())
    assert report["summary"]["steps"] == 30 and [e["step"] for e in report["log"]] == list(range(1, 31))


def test_init_head_continues_a_trained_head(
    corpus_dir: Path, trained: tuple[Path, TrainSummary], tmp_path: Path
) -> None:
    """Its weights and vocab maps are the start: the first loss is the trained head's, not a fresh one's."""
    head_dir, summary = trained
    continued = train_draft(_config(corpus_dir, tmp_path, steps=2, init_head=head_dir))
    assert continued.losses[0] < 0.7 * summary.losses[0], (continued.losses, summary.losses[:3])
    saved = torch.load(tmp_path / STATE_FILE, weights_only=True)["head"]
    started = torch.load(head_dir / STATE_FILE, weights_only=True)["head"]
    assert torch.equal(saved["t2d"], started["t2d"]) and torch.equal(saved["d2t"], started["d2t"])
    with pytest.raises(InvalidRequest, match="draft vocab of 1024, not 512"):
        train_draft(_config(corpus_dir, tmp_path / "other", init_head=head_dir, draft_vocab_size=512))
    with pytest.raises(InvalidRequest, match="feature layers"):
        train_draft(_config(corpus_dir, tmp_path / "layers", init_head=head_dir, feature_layers="0,1,2"))


def test_training_under_a_working_set(corpus_dir: Path, tmp_path: Path) -> None:
    """16 chunks of 4 tokens a window against a budget of 4: the head attends to the chosen ones and learns."""
    plain = train_draft(_config(corpus_dir, tmp_path / "plain", steps=1))
    under = train_draft(_config(corpus_dir, tmp_path / "ws", steps=12, working_set_tokens=24, chunk_size=4,
                                salience_recent_tokens=8))  # fmt: skip
    assert under.losses[0] != plain.losses[0]  # the same head and batch: other keys seen
    assert sum(under.losses[-3:]) < 0.8 * sum(under.losses[:3]), under.losses
    compacted = train_draft(_config(corpus_dir, tmp_path / "compact", steps=1, working_set_tokens=24, chunk_size=4,
                                    salience_recent_tokens=8, salience_compact_positions=True))  # fmt: skip
    assert compacted.losses[0] != under.losses[0]  # the same keys, at other positions
    with pytest.raises(ValueError, match="must be 0 or hold two chunks"):
        _config(corpus_dir, tmp_path, working_set_tokens=100, chunk_size=64)


def test_resume_continues_from_trainer_state(corpus_dir: Path, tmp_path: Path) -> None:
    first = train_draft(_config(corpus_dir, tmp_path, steps=4, save_every=2))
    resumed = train_draft(_config(corpus_dir, tmp_path, steps=7, save_every=2))
    assert (first.steps, resumed.steps) == (4, 7)
    assert resumed.losses[:4] == first.losses and len(resumed.losses) == 7
    assert resumed.tokens_seen == 7 * 4 * 64
    state = torch.load(tmp_path / STATE_FILE, weights_only=True)
    assert state["progress"]["step"] == 7 and state["progress"]["cursor"] == 7 * 4
    assert state["scheduler"]["last_epoch"] == 7
    with pytest.raises(InvalidRequest, match="seq_len"):
        train_draft(_config(corpus_dir, tmp_path, steps=9, seq_len=32))


@pytest.mark.gpu
def test_a_gpu_trains_under_a_working_set_in_bf16(corpus_dir: Path, trained: tuple[Path, TrainSummary],
                                                  tmp_path: Path) -> None:
    """The device path: bf16 autocast, the Triton ranking of the working sets, a trained head as the start."""
    head_dir, summary = trained
    run = train_draft(_config(corpus_dir, tmp_path, device="cuda", steps=3, batch_size=2, seq_len=512,
                              init_head=head_dir, working_set_tokens=128, chunk_size=16,
                              salience_recent_tokens=32))  # fmt: skip
    assert all(math.isfinite(loss) for loss in run.losses) and run.losses[0] < summary.losses[0]
