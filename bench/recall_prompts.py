"""Code prompts whose continuation lies in the far context: a file of the prompt opened again at its end.

The evaluation prompts stop mid-file, so the text just before the end predicts the continuation best, and a working
set of only the recent window drafts them as well as one with chunks chosen by score (``bench/RESULTS.md``, "The
recent window, swept"). These prompts ask the other thing: each ends by opening again, under its ``# file:``
line, a file that began far back in the context, with its first lines. The target continues by copying that
file; a draft predicts the copy only if it sees the file: the whole context does, a recent window does not,
and the working set's scored chunks must find it.

    python -m bench.recall_prompts --data ../shared/data/longctx_eval.jsonl \
        --tokenizer-model ../shared/models/bench-code --context 16384 --out /tmp/recall_16k.jsonl

then ``bench.forced_acceptance --data /tmp/recall_16k.jsonl --lengths 16384`` (the same ``--context``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from diffspec.errors import CheckpointError
from diffspec.settings import DiffSpecSettings
from gateway.assembly import load_tokenizer

FILE_LINE = re.compile(r"^# file: (.+)$", re.MULTILINE)  # each file of a prompt starts under one


@dataclass(frozen=True)
class SourceFile:
    path: str  # as its ``# file:`` line names it
    start: int  # [chars] where its ``# file:`` line starts in the prompt
    text: str  # its ``# file:`` line and body
    tokens_from_end: int  # tokens from its start to the prompt's end (files tokenised apart: a close estimate)
    tokens: int  # its own length in tokens


def source_files(text: str, count_tokens: Callable[[str], int]) -> list[SourceFile]:
    """The prompt's files in order, the text before the first ``# file:`` line left out."""
    starts = [m.start() for m in FILE_LINE.finditer(text)]
    spans = [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)])]
    lengths = [count_tokens(span) for span in spans]
    behind = [sum(lengths[i:]) for i in range(len(spans))]
    return [SourceFile(FILE_LINE.match(span).group(1), start, span, from_end, n)
            for start, span, from_end, n in zip(starts, spans, behind, lengths)]


def recalled_file(files: list[SourceFile], context: int, lead_tokens: int, min_tokens: int) -> SourceFile | None:
    """The file to open again: the first whose start lies between three quarters and a quarter of ``context``
    tokens from the end (inside the prompt cut to ``context`` with room for its lead, and far past any recent
    window), at least ``min_tokens`` long, and not the file the prompt stops in (its copy would be the
    continuation of the text just before it)."""
    far, near = context * 3 // 4 - lead_tokens, context // 4
    for file in files[:-1]:
        if near <= file.tokens_from_end <= far and file.tokens >= min_tokens:
            return file
    return None


def lead_of(file: SourceFile, lead_tokens: int, count_tokens: Callable[[str], int]) -> str:
    """The file's ``# file:`` line and its first lines, whole lines up to about ``lead_tokens`` tokens."""
    lines = file.text.splitlines(keepends=True)
    taken = 1
    while taken < len(lines) and count_tokens("".join(lines[:taken])) < lead_tokens:
        taken += 1
    return "".join(lines[:taken])


def recall_prompt(row: dict, context: int, lead_tokens: int, min_tokens: int,
                  count_tokens: Callable[[str], int]) -> dict | None:
    """The prompt with a far file opened again at its end (on a line of its own), or None when no file fits."""
    files = source_files(row["text"], count_tokens)
    file = recalled_file(files, context, lead_tokens, min_tokens)
    if file is None:
        return None
    text = row["text"] if row["text"].endswith("\n") else row["text"] + "\n"
    return {"id": f"recall-{row.get('id', '')}", "source": row.get("source", ""),
            "text": text + lead_of(file, lead_tokens, count_tokens),
            "recalled_file": file.path, "recalled_tokens_back": file.tokens_from_end}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="a JSONL of prompts with `# file:` lines")
    parser.add_argument("--tokenizer-model", type=Path, required=True, help="a checkpoint folder with the tokenizer")
    parser.add_argument("--context", type=int, required=True, help="the prompt tokens the prompts are cut to")
    parser.add_argument("--lead-tokens", type=int, default=64, help="about how much of the file opens it again")
    parser.add_argument("--min-file-tokens", type=int, default=1024, help="files shorter than this are passed over")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.context < 8 * args.lead_tokens or args.lead_tokens < 1:
        parser.error(f"--context {args.context} must be at least 8 x --lead-tokens {args.lead_tokens} (>= 1)")
    try:
        tokenizer = load_tokenizer(DiffSpecSettings(base_model=args.tokenizer_model))
    except CheckpointError as bad:
        parser.error(str(bad))

    def count_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    prompts = [p for row in rows if (p := recall_prompt(row, args.context, args.lead_tokens,
                                                        args.min_file_tokens, count_tokens))]
    args.out.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    print(f"{len(prompts)} of {len(rows)} prompts reopen a file {args.context // 4}-{args.context * 3 // 4} "
          f"tokens back: {args.out}", file=sys.stderr)
    return 0 if prompts else 1


if __name__ == "__main__":
    raise SystemExit(main())
