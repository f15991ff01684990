"""What ``diffspec generate`` prints: the text as it streams (or JSON lines), prefill progress on
stderr, and a one-line speed summary."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator

if TYPE_CHECKING:  # the CLI's help and argument errors import neither torch nor the engine
    from gateway.request import GenerationChunk, GenerationStats


@dataclass
class Generated:
    token_ids: list[int]
    text: str
    stats: GenerationStats


class PrefillBar:
    """A progress bar on stderr for prompts that take more than one prefill chunk."""

    def __init__(self) -> None:
        self.bar = None

    def update(self, done: int, total: int) -> None:
        from tqdm import tqdm

        if self.bar is None and done < total:
            self.bar = tqdm(total=total, unit="tok", desc="prefill", file=sys.stderr, leave=False)
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            if done >= total:
                self.bar.close()
                self.bar = None


async def show(chunks: AsyncIterator[GenerationChunk], as_json: bool, quiet: bool = False) -> Generated:
    """Print a generation as it streams: text, or one JSON object per chunk (the last with all ids,
    the whole text and the stats); ``quiet`` prints nothing. Returns what was generated."""
    ids: list[int] = []
    text = ""
    bar = PrefillBar()
    async for chunk in chunks:
        if chunk.prefill_progress is not None:
            if not quiet:
                bar.update(*chunk.prefill_progress)
            continue
        ids += chunk.token_ids
        text += chunk.text
        if not quiet:
            _print_chunk(chunk, ids, text, as_json)
        if chunk.stats is not None:
            return Generated(ids, text, chunk.stats)
    raise RuntimeError("the generation ended without its stats")


def _print_chunk(chunk: GenerationChunk, ids: list[int], text: str, as_json: bool) -> None:
    """``ids`` and ``text``: everything so far, which the last JSON line carries whole."""
    if as_json and chunk.stats is not None:
        print(json.dumps({"token_ids": ids, "text": text, "stats": chunk.stats.to_dict()}), flush=True)
    elif as_json:
        print(json.dumps({"token_ids": chunk.token_ids, "text": chunk.text}), flush=True)
    else:
        print(chunk.text, end="\n" if chunk.stats is not None else "", flush=True)


def summary_line(run: Generated, auto: Generated | None = None) -> str:
    """``64 tokens, 41.2 tokens/s, tau 3.05, 2.31x Auto (17.8 tokens/s, same tokens)``: decode speed,
    from the first token to the last; the speedup compares the same request run with Auto."""
    stats = run.stats
    line = f"{stats.new_tokens} tokens, {stats.decode_tokens_per_second:.1f} tokens/s"
    line += f", tau {stats.mean_accepted_length:.2f}"
    if auto is not None and auto.stats.decode_tokens_per_second > 0:
        speedup = stats.decode_tokens_per_second / auto.stats.decode_tokens_per_second
        same = "same tokens" if auto.token_ids == run.token_ids else "different tokens"
        line += f", {speedup:.2f}x Auto ({auto.stats.decode_tokens_per_second:.1f} tokens/s, {same})"
    return line
