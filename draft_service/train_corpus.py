"""The trainer's data: corpus files read as documents, packed into windows, batched in a resumable order."""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import torch
from transformers import PreTrainedTokenizerBase

from diffspec.errors import InvalidRequest
from draft_service.train_config import TrainConfig


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
