"""Evaluation prompts: JSONL files with a ``text`` field per line, or plain text files (one prompt
each), tokenised once and cut to each context target by keeping their end (so they still stop
mid-file) behind the leading <|bos|>."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class Dataset:
    name: str  # the file's stem
    prompt_ids: list[list[int]]  # [prompt][tokens], whole prompts, <|bos|> first when the tokenizer adds one


def read_texts(path: Path) -> list[str]:
    """A JSONL file's ``text`` fields, or a plain file's whole text."""
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        missing = [i for i, row in enumerate(rows) if "text" not in row]
        if missing:
            raise ValueError(f"{path}: lines {missing[:5]} have no 'text' field")
        return [row["text"] for row in rows]
    return [path.read_text()]


def load_datasets(paths: list[Path], tokenize: Callable[[str], list[int]]) -> list[Dataset]:
    """One dataset per file; two plain files with one stem would collide, so names stay unique."""
    datasets: list[Dataset] = []
    for path in paths:
        name = path.stem if all(d.name != path.stem for d in datasets) else str(path)
        datasets.append(Dataset(name, [tokenize(text) for text in read_texts(path)]))
    return datasets


def cut_to_context(ids: list[int], context: int) -> list[int]:
    """The first token (<|bos|>) and the last ``context - 1``: ``context`` tokens in all."""
    return ids[:1] + ids[1:][-(context - 1):]


def prompts_at(
    dataset: Dataset, context: int, first: int, count: int, long_enough_for: int | None = None
) -> list[tuple[int, list[int]]]:
    """Up to ``count`` (index, prompt) pairs from index ``first`` on, each cut to ``context``, among prompts at
    least ``long_enough_for`` tokens long (default ``context``: shorter prompts cannot fill the context and are
    passed over). Every context choosing by the longest one takes the same texts, so that context length is
    the only difference between them (a cut keeps the prompt's end, where generation continues)."""
    chosen: list[tuple[int, list[int]]] = []
    for index in range(first, len(dataset.prompt_ids)):
        if len(chosen) == count:
            break
        if len(dataset.prompt_ids[index]) >= max(context, long_enough_for or 0):
            chosen.append((index, cut_to_context(dataset.prompt_ids[index], context)))
    return chosen
