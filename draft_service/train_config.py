"""The settings of one EAGLE-3 training run.

Torch-free, so that ``diffspec train-draft --help`` and argument errors need no model import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from diffspec.settings import BUNDLED_TARGET
from draft_service.working_set import WorkingSetConfig


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
    init_head: Path | None = Field(None, description="Start from this EAGLE-3 head (published layout) instead of "
                                   "a fresh one, e.g. to train a short-context head on long windows; its draft "
                                   "vocab and feature layers are kept.")
    working_set_tokens: int = Field(0, ge=0, description="Train the head as served with salience: each position "
                                    "attends to a working set of at most this many context tokens (sinks, recent "
                                    "chunks, best-scoring chunks, chosen as serving chooses them) plus its own "
                                    "chunk; 0 = every earlier position. Serving's working_set_tokens.")
    chunk_size: int = Field(64, ge=1, description="Context tokens per salience chunk (with working_set_tokens).")
    salience_recent_tokens: int = Field(0, ge=0, description="Most recent context tokens always in the working "
                                        "set (with working_set_tokens); 0 = three quarters of it, as serving's default.")
    salience_compact_positions: bool = Field(False, description="Train with the working set's positions compacted "
                                             "(with working_set_tokens), as serving's salience_compact_positions "
                                             "stages them: the head then learns the set as a context of its length.")

    @model_validator(mode="after")
    def _check_sizes(self) -> TrainConfig:
        if self.seq_len <= self.ttt_steps:
            raise ValueError(f"seq_len {self.seq_len} must exceed ttt_steps {self.ttt_steps} "
                             "(each unrolled step drops a position)")
        if 0 < self.working_set_tokens < 2 * self.chunk_size:
            raise ValueError(f"working_set_tokens {self.working_set_tokens} must be 0 or hold two chunks of "
                             f"chunk_size {self.chunk_size}")
        if self.working_set_tokens:
            self.working_set()  # its own sink and recent chunks must fit
        return self

    def working_set(self) -> WorkingSetConfig | None:
        """What each position attends to in training, as serving's settings make it; None: every earlier one."""
        if not self.working_set_tokens:
            return None
        return WorkingSetConfig.of_tokens(self.chunk_size, self.working_set_tokens, self.salience_recent_tokens,
                                          compact_positions=self.salience_compact_positions).fitting()
