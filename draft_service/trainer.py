"""Train an EAGLE-3 head against a frozen target, online, with the training-time-test (TTT) unroll.

Per batch the target runs once without grad for the features of three layers and its soft
labels. The head is then unrolled ``ttt_steps`` times: step 0 reads fc(feature[t]) with token
t+1 and predicts the target's distribution at t+1 (its guess for token t+2); step k reads its
own step k-1 output at t with token t+1+k. At step k position t attends to the step-0 keys at
positions <= t plus its own keys of steps 1..k, the mask of EAGLE-3's reference trainer and what
a depth-k tree node sees at inference (context keys plus its own ancestors).
"""

from __future__ import annotations

import fnmatch
import json
import math
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Iterator, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from tqdm import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from diffspec.devices import resolve_device, resolve_dtype
from diffspec.errors import InvalidRequest
from diffspec.settings import BUNDLED_TARGET, resolve_feature_layers
from draft_service.eagle3_head import Eagle3Config, Eagle3Head
from draft_service.vocab_map import build_vocab_map, target_to_draft_index
from target_service.llama import LlamaModel

STATE_FILE = "trainer_state.pt"
# A resumed run must read the same data into the same head shape; the rest may change between runs.
RESUME_KEYS = ("base_model", "corpus", "exclude", "max_files", "max_tokens", "seq_len", "draft_vocab_size",
               "feature_layers", "seed")


class TrainConfig(BaseModel):
    """One training run; each field is also a ``--flag`` of the CLI."""

    model_config = ConfigDict(extra="forbid")

    base_model: Path = Field(BUNDLED_TARGET, description="Target checkpoint directory (HF layout, with tokenizer).")
    corpus: list[Path] = Field(
        min_length=1,
        description="Training text: files, directories (searched recursively for *.py and *.txt), "
        "or *.jsonl files with a 'text' field per row. One document per file or row.",
    )
    out_dir: Path = Field(Path("runs/eagle3-head"), description="Head (published layout), training.json and "
                          "trainer_state.pt go here; a rerun with the same out_dir resumes.")
    steps: int = Field(2000, ge=1, description="Optimizer steps in total (a resumed run continues up to this).")
    seq_len: int = Field(1024, ge=2, description="Tokens per training window (documents packed, eos between them).")
    batch_size: int = Field(8, ge=1, description="Windows per optimizer step.")
    lr: float = Field(5e-4, gt=0, description="Peak AdamW learning rate. The published 5e-5 is for 8B-sized heads; "
                      "small heads (hidden <= 1024) train well around 5e-4.")
    warmup_steps: int = Field(50, ge=0, description="Linear warmup steps before the cosine decay to zero.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    ttt_steps: int = Field(7, ge=1, description="Training-time-test unroll: draft steps fed their own outputs.")
    decay: float = Field(0.8, gt=0, le=1, description="Loss weight of unrolled step k is decay**k.")
    grad_clip: float = Field(0.5, gt=0, description="Gradient-norm clip.")
    draft_vocab_size: int = Field(32000, ge=1, description="Draft vocab: the most frequent corpus tokens; capped at "
                                  "the target vocab (then the maps are the identity).")
    feature_layers: str = Field("auto", description="Comma-separated target layers feeding the head; "
                                "auto = 2, L//2, L-3.")
    device: str = Field("auto", description="torch device: auto, cpu, cuda, cuda:N.")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Target dtype and the head's autocast dtype (head weights and AdamW stay float32); "
        "auto = bfloat16 on GPU, float32 on CPU.")
    seed: int = Field(0, description="Seeds the head's init and the window order.")
    save_every: int = Field(500, ge=1, description="Write trainer_state.pt and the head every this many steps.")
    log_every: int = Field(10, ge=1, description="Average loss/accuracy over this many steps per log entry.")
    exclude: list[str] = Field(default_factory=list, description="Skip corpus files whose path contains one of "
                               "these substrings or matches one of these globs (e.g. site-packages).")
    max_files: int = Field(0, ge=0, description="Read at most this many corpus files (0 = all).")
    max_tokens: int = Field(0, ge=0, description="Stop reading the corpus after this many tokens (0 = all).")

    @model_validator(mode="after")
    def _check_unroll(self) -> TrainConfig:
        if self.seq_len <= self.ttt_steps:
            raise ValueError(f"seq_len {self.seq_len} must exceed ttt_steps {self.ttt_steps} "
                             "(each unrolled step drops a position)")
        return self


@dataclass
class TrainSummary:
    steps: int  # optimizer steps done in total, resumed runs included
    seconds: float  # training wall time in total
    final_loss: float  # weighted TTT loss, mean over the last log window
    step_accuracy: list[float]  # [ttt_steps] top-1 agreement with the target per unrolled step, last log window
    tokens_seen: int
    losses: list[float] = field(default_factory=list)  # mean loss of every log window, oldest first


# -- data ------------------------------------------------------------------------------------


@dataclass
class TokenCorpus:
    windows: torch.Tensor  # [num_windows, seq_len] int64, packed documents
    token_counts: torch.Tensor  # [vocab] int64, over every token read


def corpus_files(paths: list[Path], exclude: list[str], max_files: int) -> list[Path]:
    """Files named directly plus *.py / *.txt under directories, sorted, excluded ones dropped."""
    found: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found += sorted(p for p in path.rglob("*") if p.suffix in (".py", ".txt") and p.is_file())
        elif path.is_file():
            found.append(path)
        else:
            raise InvalidRequest(f"corpus path {path} does not exist")
    kept = [p for p in dict.fromkeys(found) if not any(x in str(p) or fnmatch.fnmatch(str(p), x) for x in exclude)]
    return kept[:max_files] if max_files else kept


def read_documents(files: list[Path]) -> Iterator[str]:
    """One document per file, or per row of a *.jsonl file (its "text" field)."""
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if path.suffix != ".jsonl":
            yield text
            continue
        for line_no, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    yield json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError, TypeError) as bad:
                    raise InvalidRequest(f"{path}:{line_no}: expected a JSON object with 'text' ({bad})") from None


def tokenize_corpus(
    config: TrainConfig, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_id: int
) -> TokenCorpus:
    """Documents joined by eos into one stream, cut into seq_len windows; counts feed the draft vocab."""
    files = corpus_files(config.corpus, config.exclude, config.max_files)
    chunks: list[torch.Tensor] = []
    total, batch = 0, []
    for text in read_documents(files):
        batch.append(text)
        if len(batch) == 64:
            total += _encode(tokenizer, batch, eos_id, chunks)
            batch = []
            if config.max_tokens and total >= config.max_tokens:
                break
    _encode(tokenizer, batch, eos_id, chunks)  # the last partial batch (empty after an early stop)
    stream = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.int64)
    stream = stream[: config.max_tokens] if config.max_tokens else stream
    num_windows = stream.numel() // config.seq_len
    if num_windows == 0:
        raise InvalidRequest(
            f"corpus gave {stream.numel()} tokens from {len(files)} files; need >= seq_len {config.seq_len}"
        )
    windows = stream[: num_windows * config.seq_len].view(num_windows, config.seq_len)
    return TokenCorpus(windows=windows, token_counts=torch.bincount(stream, minlength=vocab_size))


def _encode(tokenizer: PreTrainedTokenizerBase, texts: list[str], eos_id: int, out: list[torch.Tensor]) -> int:
    """Tokenize a batch of documents (the fast tokenizer runs them in parallel), each followed by eos."""
    texts = [t for t in texts if t.strip()]
    if not texts:
        return 0
    encoded = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]  # no per-document length warning
    ids = torch.tensor([i for doc in encoded for i in (*doc, eos_id)], dtype=torch.int64)
    out.append(ids)
    return ids.numel()


@lru_cache(maxsize=4)
def _epoch_order(num_windows: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(num_windows, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def batch_indices(num_windows: int, batch_size: int, cursor: int, seed: int) -> torch.Tensor:
    """Windows cursor..cursor+batch_size of a seeded reshuffle per epoch; the cursor is the resumable position."""
    return torch.stack([_epoch_order(num_windows, seed, p // num_windows)[p % num_windows]
                        for p in range(cursor, cursor + batch_size)])


# -- the training-time-test unroll -------------------------------------------------------------


def ttt_attention(
    q: torch.Tensor,  # [B, L, heads, hd] queries of positions 0..L-1
    k0: torch.Tensor,  # [B, L, kv_heads, hd] step-0 keys, seen causally
    v0: torch.Tensor,  # [B, L, kv_heads, hd]
    diag_k: torch.Tensor,  # [B, L, n, kv_heads, hd] each position's own keys of steps 1..n (n may be 0)
    diag_v: torch.Tensor,  # [B, L, n, kv_heads, hd]
    scale: float,
) -> torch.Tensor:
    """One unrolled step's attention -> [B, L, heads, hd]; GQA by grouping query heads per kv head."""
    length, kv_heads = q.shape[1], k0.shape[2]
    qg = q.unflatten(2, (kv_heads, -1))  # [B, L, kv_heads, group, hd]
    causal = torch.einsum("bqngd,bknd->bngqk", qg, k0) * scale  # [B, kv_heads, group, L, L]
    future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
    causal = causal.masked_fill(future, float("-inf"))
    diagonal = torch.einsum("bqngd,bqjnd->bngqj", qg, diag_k) * scale  # [B, kv_heads, group, L, n]
    probs = torch.softmax(torch.cat([causal, diagonal], dim=-1).float(), dim=-1).to(v0.dtype)
    out = torch.einsum("bngqk,bknd->bqngd", probs[..., :length], v0)
    out = out + torch.einsum("bngqj,bqjnd->bqngd", probs[..., length:], diag_v)
    return out.flatten(2, 3)


def ttt_forward(
    head: Eagle3Head, token_ids: torch.Tensor, features: torch.Tensor, ttt_steps: int
) -> list[torch.Tensor]:
    """token_ids [B, S], target features [B, S, 3h] -> draft output of each unrolled step k, [B, S-1-k, h].

    Output k at position t has read tokens t+1..t+1+k and predicts the target's distribution at
    t+1+k. It runs at position t+k, as a depth-k tree node sits k past its root (the reference's
    ``position_ids + lck``). Positions whose token t+1+k lies past the window are dropped.
    """
    seq = token_ids.shape[1]
    positions = torch.arange(seq - 1, device=token_ids.device).expand(token_ids.shape[0], -1)
    hidden = head.fuse(features[:, :-1])
    outputs: list[torch.Tensor] = []
    own_k: list[torch.Tensor] = []
    own_v: list[torch.Tensor] = []
    for k in range(ttt_steps):
        length = seq - 1 - k
        hidden = hidden[:, :length]
        q, key, value = head.attention_inputs(token_ids[:, 1 + k :], hidden, positions[:, :length] + k)
        if k == 0:
            k0, v0 = key, value
        else:
            own_k.append(key)
            own_v.append(value)
        diag_k, diag_v = (_stack_steps(xs, length, key) for xs in (own_k, own_v))
        attn = ttt_attention(q, k0[:, :length], v0[:, :length], diag_k, diag_v, head.scale)
        hidden = head.attention_outputs(attn, hidden)
        outputs.append(hidden)
    return outputs


def _stack_steps(per_step: list[torch.Tensor], length: int, like: torch.Tensor) -> torch.Tensor:
    """[B, >=L, kv_heads, hd] per step -> [B, L, steps, kv_heads, hd] (steps may be 0)."""
    if not per_step:
        return like.unsqueeze(2)[:, :, :0]
    return torch.stack([x[:, :length] for x in per_step], dim=2)


@dataclass
class SoftLabels:
    probs: torch.Tensor  # [B, S, draft_vocab] float32 target softmax restricted to the draft vocab
    draft_ids: torch.Tensor  # [B, S] int64 draft id of the target's argmax, -1 outside the draft vocab


def soft_labels(target_logits: torch.Tensor, used_ids: torch.Tensor, target_to_draft: torch.Tensor) -> SoftLabels:
    """target_logits [B, S, vocab] float32; used_ids [draft_vocab] target ids; target_to_draft [vocab]."""
    probs = torch.softmax(target_logits.index_select(-1, used_ids), dim=-1)
    return SoftLabels(probs=probs, draft_ids=target_to_draft[target_logits.argmax(-1)])


def ttt_loss(
    head: Eagle3Head, outputs: list[torch.Tensor], labels: SoftLabels, decay: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (sum_k decay**k * soft CE_k, top-1 accuracy [ttt_steps]).

    CE_k averages over step k's positions with positions whose target argmax is outside the
    draft vocab contributing zero (as the reference); accuracy counts those as misses.
    """
    losses, accuracy = [], []
    for k, output in enumerate(outputs):
        length = output.shape[1]
        log_probs = F.log_softmax(head.draft_logits(output), dim=-1)  # [B, L, draft_vocab]
        probs = labels.probs[:, 1 + k : 1 + k + length]
        draft_ids = labels.draft_ids[:, 1 + k : 1 + k + length]
        cross_entropy = -(probs * log_probs).sum(-1)  # [B, L]
        losses.append((cross_entropy * (draft_ids >= 0)).mean())
        accuracy.append((log_probs.argmax(-1) == draft_ids).float().mean())
    total = torch.stack([decay**k * loss for k, loss in enumerate(losses)]).sum()
    return total, torch.stack(accuracy).detach()


# -- the run -----------------------------------------------------------------------------------


@dataclass
class _Progress:
    """Everything besides tensors that a resumed run needs, saved in trainer_state.pt."""

    step: int = 0
    cursor: int = 0  # windows consumed so far: the data position
    tokens_seen: int = 0
    seconds: float = 0.0
    log: list[dict] = field(default_factory=list)  # {"step", "loss", "accuracy" [ttt_steps], "lr"} per log window

    def record(self, loss: float, accuracy: list[float], lr: float) -> str:
        """Append a log entry -> the progress bar's text."""
        rounded = [round(a, 4) for a in accuracy]
        self.log.append({"step": self.step, "loss": round(loss, 5), "accuracy": rounded, "lr": lr})
        return f"loss {loss:.3f} acc " + "/".join(f"{a:.2f}" for a in accuracy)

    def summary(self) -> TrainSummary:
        last = self.log[-1] if self.log else {"loss": math.nan, "accuracy": []}
        return TrainSummary(steps=self.step, seconds=round(self.seconds, 3), final_loss=last["loss"],
                            step_accuracy=last["accuracy"], tokens_seen=self.tokens_seen,
                            losses=[entry["loss"] for entry in self.log])


@dataclass
class _Run:
    """The live objects of one run; ``train_step`` is the hot path and reads nothing back from the device."""

    config: TrainConfig
    device: torch.device
    dtype: torch.dtype  # target dtype; the head's autocast dtype unless float32
    target: LlamaModel
    layers: tuple[int, ...]
    corpus: TokenCorpus
    head: Eagle3Head
    used_ids: torch.Tensor  # [draft_vocab] target id of each draft id
    target_to_draft: torch.Tensor  # [vocab] draft id of each target id, -1 outside the draft vocab
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR

    @staticmethod
    def build(config: TrainConfig) -> _Run:
        torch.manual_seed(config.seed)
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        target = LlamaModel.from_pretrained(config.base_model, device, dtype)
        tc = target.config
        layers = resolve_feature_layers(config.feature_layers, tc.num_layers)
        tokenizer = AutoTokenizer.from_pretrained(config.base_model)
        eos_id = tc.eos_token_ids[0] if tc.eos_token_ids else tokenizer.eos_token_id
        if eos_id is None:
            raise InvalidRequest(f"{config.base_model} names no eos token to separate documents")
        corpus = tokenize_corpus(config, tokenizer, tc.vocab_size, eos_id)
        d2t, t2d = build_vocab_map(corpus.token_counts, min(config.draft_vocab_size, tc.vocab_size))
        # Head weights, and so AdamW's state, stay float32 whatever the target dtype.
        head = Eagle3Head(Eagle3Config.for_target(tc, d2t.numel(), layers), target.embed_tokens.float())
        head.set_vocab_map(d2t.to(device), t2d.to(device))
        optimizer = torch.optim.AdamW(
            head.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: _lr_factor(step, config.warmup_steps, config.steps)
        )
        return _Run(config, device, dtype, target, layers, corpus, head,
                    used_ids=head.to_target_ids(torch.arange(d2t.numel(), device=device)),
                    target_to_draft=target_to_draft_index(t2d).to(device), optimizer=optimizer, scheduler=scheduler)

    def train_step(self, cursor: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on the batch at ``cursor`` -> (loss, accuracy [ttt_steps]) still on the device."""
        c = self.config
        rows = batch_indices(len(self.corpus.windows), c.batch_size, cursor, c.seed)
        token_ids = self.corpus.windows[rows].to(self.device)  # [B, S]
        with torch.no_grad():
            final_hidden, features = self.target.forward_dense(token_ids, self.layers)
            labels = soft_labels(self.target.logits(final_hidden), self.used_ids, self.target_to_draft)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            outputs = ttt_forward(self.head, token_ids, features, c.ttt_steps)
            loss, accuracy = ttt_loss(self.head, outputs, labels, c.decay)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), c.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        return loss.detach(), accuracy

    def resume(self) -> _Progress:
        path = self.config.out_dir / STATE_FILE
        if not path.exists():
            return _Progress()
        state = torch.load(path, map_location=self.device, weights_only=True)
        saved, now = state["config"], self.config.model_dump(mode="json")
        changed = [key for key in RESUME_KEYS if saved.get(key) != now[key]]
        if changed:
            raise InvalidRequest(f"{path} belongs to a run with other {', '.join(changed)}; pick another out_dir")
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        return _Progress(**state["progress"])

    def save(self, progress: _Progress) -> None:
        """The head in the published layout, training.json, and trainer_state.pt (written atomically)."""
        out_dir = self.config.out_dir
        self.head.save(out_dir)
        config = self.config.model_dump(mode="json")
        state = {"head": self.head.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict(), "progress": asdict(progress), "config": config}
        partial = out_dir / f"{STATE_FILE}.partial"
        torch.save(state, partial)
        partial.replace(out_dir / STATE_FILE)
        report = {"config": config, "summary": asdict(progress.summary()), "log": progress.log}
        (out_dir / "training.json").write_text(json.dumps(report, indent=2) + "\n")


def _lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warmup to the peak, then cosine decay towards zero at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    done = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, done)))


def train_draft(config: TrainConfig) -> TrainSummary:
    """Train a head, or resume the one in ``config.out_dir``, up to ``config.steps``."""
    run = _Run.build(config)
    progress = run.resume()
    bar = tqdm(total=config.steps, initial=progress.step, desc="eagle3 head", dynamic_ncols=True)
    started, seconds_before = time.perf_counter(), progress.seconds
    window: list[tuple[torch.Tensor, torch.Tensor]] = []  # (loss, accuracy) per step, read at log time only
    while progress.step < config.steps:
        lr = run.scheduler.get_last_lr()[0]  # the rate this step uses
        window.append(run.train_step(progress.cursor))
        progress.step += 1
        progress.cursor += config.batch_size
        progress.tokens_seen += config.batch_size * config.seq_len
        bar.update()
        last = progress.step == config.steps
        if progress.step % config.log_every == 0 or last:
            losses, accuracies = (torch.stack(column) for column in zip(*window))
            bar.set_postfix_str(progress.record(losses.mean().item(), accuracies.mean(0).tolist(), lr))
            window.clear()
        if progress.step % config.save_every == 0 or last:
            progress.seconds = seconds_before + time.perf_counter() - started
            run.save(progress)
    bar.close()
    return progress.summary()
