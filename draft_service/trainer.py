"""Train an EAGLE-3 head against a frozen target, online: the run's loop, resuming and checkpoints.

Per batch the target runs once without grad for the features of three layers and its soft
labels; the head is then unrolled and scored as in ``ttt_unroll``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from diffspec.devices import resolve_device, resolve_dtype
from diffspec.errors import InvalidRequest
from diffspec.settings import resolve_feature_layers
from draft_service.eagle3_head import Eagle3Config, Eagle3Head
from draft_service.train_config import TrainConfig
from draft_service.train_corpus import TokenCorpus, batch_indices, tokenize_corpus
from draft_service.ttt_unroll import soft_labels, ttt_forward, ttt_loss
from draft_service.vocab_map import build_vocab_map, target_to_draft_index
from draft_service.working_set import WorkingSetConfig
from target_service.llama import LlamaModel

STATE_FILE = "trainer_state.pt"
# A resumed run must read the same data into the same head shape; the rest may change between runs.
RESUME_KEYS = ("base_model", "corpus", "exclude", "max_files", "max_tokens", "seq_len", "draft_vocab_size",
               "feature_layers", "seed", "init_head")


@dataclass
class TrainSummary:
    steps: int  # optimizer steps done in total, resumed runs included
    seconds: float  # training wall time in total
    final_loss: float  # weighted TTT loss, mean over the last log window
    step_accuracy: list[float]  # [ttt_steps] top-1 agreement with the target per unrolled step, last log window
    tokens_seen: int
    losses: list[float] = field(default_factory=list)  # mean loss of every log window, oldest first


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
    working_set: WorkingSetConfig | None  # what each position attends to; None: every earlier position
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
        tokenizer = AutoTokenizer.from_pretrained(config.base_model)
        eos_id = tc.eos_token_ids[0] if tc.eos_token_ids else tokenizer.eos_token_id
        if eos_id is None:
            raise InvalidRequest(f"{config.base_model} names no eos token to separate documents")
        corpus = tokenize_corpus(config, tokenizer, tc.vocab_size, eos_id)
        # Head weights, and so AdamW's state, stay float32 whatever the target dtype.
        if config.init_head is not None:
            head, layers = _initial_head(config, target, device)
        else:
            layers = resolve_feature_layers(config.feature_layers, tc.num_layers)
            d2t, t2d = build_vocab_map(corpus.token_counts, min(config.draft_vocab_size, tc.vocab_size))
            head = Eagle3Head(Eagle3Config.for_target(tc, d2t.numel(), layers), target.embed_tokens.float())
            head.set_vocab_map(d2t.to(device), t2d.to(device))
        working_set = config.working_set()
        optimizer = torch.optim.AdamW(
            head.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: _lr_factor(step, config.warmup_steps, config.steps)
        )
        return _Run(config, device, dtype, target, layers, corpus, head, working_set,
                    used_ids=head.to_target_ids(torch.arange(head.config.draft_vocab_size, device=device)),
                    target_to_draft=target_to_draft_index(head.t2d).to(device), optimizer=optimizer,
                    scheduler=scheduler)

    def train_step(self, cursor: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on the batch at ``cursor`` -> (loss, accuracy [ttt_steps]) still on the device."""
        c = self.config
        rows = batch_indices(len(self.corpus.windows), c.batch_size, cursor, c.seed)
        token_ids = self.corpus.windows[rows].to(self.device)  # [B, S]
        with torch.no_grad():
            final_hidden, features = self.target.forward_dense(token_ids, self.layers)
            labels = soft_labels(self.target.logits(final_hidden), self.used_ids, self.target_to_draft)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            outputs = ttt_forward(self.head, token_ids, features, c.ttt_steps, self.working_set)
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


def _initial_head(
    config: TrainConfig, target: LlamaModel, device: torch.device
) -> tuple[Eagle3Head, tuple[int, ...]]:
    """``config.init_head`` in float32, checked against the target and the flags it overrides; with the target
    layers it reads."""
    assert config.init_head is not None
    head = Eagle3Head.load(config.init_head, target.embed_tokens.float(), device, torch.float32)
    c, tc = head.config, target.config
    if c.target_hidden_size != tc.hidden_size:
        raise InvalidRequest(f"head {config.init_head} reads features of a {c.target_hidden_size}-wide target; "
                             f"{config.base_model} is {tc.hidden_size} wide")
    layers = c.feature_layers or resolve_feature_layers("auto", tc.num_layers)  # () = the target's default rule
    given = config.model_fields_set
    if "feature_layers" in given and resolve_feature_layers(config.feature_layers, tc.num_layers) != tuple(layers):
        raise InvalidRequest(f"head {config.init_head} was trained on feature layers {tuple(layers)}, "
                             f"not {config.feature_layers}")
    if "draft_vocab_size" in given and config.draft_vocab_size != c.draft_vocab_size:
        raise InvalidRequest(f"head {config.init_head} has a draft vocab of {c.draft_vocab_size}, "
                             f"not {config.draft_vocab_size}")
    return head, tuple(layers)


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
