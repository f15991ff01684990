"""What ``diffspec generate`` prints: the text as it streams (or JSON lines), prefill progress on
stderr, and a one-line speed summary per sample.

With ``n`` > 1 the samples' chunks interleave: JSON lines carry each chunk's ``index``, and text
mode prints each sample whole, under a header line, once it ends.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator

from diffspec.sampling_params import TokenLogprobs

if TYPE_CHECKING:  # the CLI's help and argument errors import neither torch nor the engine
    from gateway.request import GenerationChunk, GenerationStats


@dataclass
class Generated:
    """One sample, as far as it has come."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # per chunk, when asked for
    stats: GenerationStats | None = None  # set by its last chunk

    def add(self, chunk: GenerationChunk) -> None:
        self.token_ids += chunk.token_ids
        self.text += chunk.text
        if chunk.logprobs is not None:
            self.logprobs.append(chunk.logprobs)
        self.stats = chunk.stats or self.stats

    def to_json(self, index: int | None) -> dict:
        """The whole sample, as the last JSON line of its stream."""
        assert self.stats is not None
        whole = {"token_ids": self.token_ids, "text": self.text, "stats": self.stats.to_dict()}
        return _tagged(whole, index, TokenLogprobs.join(self.logprobs) if self.logprobs else None)


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


async def show(
    chunks: AsyncIterator[GenerationChunk], as_json: bool, num_samples: int = 1, quiet: bool = False
) -> list[Generated]:
    """Print a generation as it streams: text, or one JSON object per chunk (each sample's last with all
    its ids, its whole text and its stats); ``quiet`` prints nothing. Returns the samples in index order."""
    samples = [Generated() for _ in range(num_samples)]
    index = (lambda chunk: chunk.index) if num_samples > 1 else (lambda chunk: None)  # tagged only when n > 1
    bar = PrefillBar()
    async for chunk in chunks:
        if chunk.prefill_progress is not None:
            if not quiet:
                bar.update(*chunk.prefill_progress)
            continue
        sample = samples[chunk.index]
        sample.add(chunk)
        if quiet:
            continue
        if as_json:
            line = sample.to_json(index(chunk)) if chunk.stats is not None else _chunk_json(chunk, index(chunk))
            print(json.dumps(line), flush=True)
        elif num_samples == 1:
            print(chunk.text, end="\n" if chunk.stats is not None else "", flush=True)
        elif chunk.stats is not None:
            print(f"--- sample {chunk.index} ---\n{sample.text}", flush=True)
    if any(sample.stats is None for sample in samples):
        raise RuntimeError("the generation ended without the stats of every sample")
    return samples


def _chunk_json(chunk: GenerationChunk, index: int | None) -> dict:
    return _tagged({"token_ids": chunk.token_ids, "text": chunk.text}, index, chunk.logprobs)


def _tagged(line: dict, index: int | None, logprobs: TokenLogprobs | None) -> dict:
    """``line`` with the sample's index (n > 1) and its tokens' logprobs (when asked for)."""
    if index is not None:
        line["index"] = index
    if logprobs is not None:
        line["logprobs"] = dataclasses.asdict(logprobs)
    return line


def summary_line(run: Generated, auto: Generated | None = None) -> str:
    """``64 tokens, 41.2 tokens/s, tau 3.05, 2.31x Auto (17.8 tokens/s, same tokens)``: decode speed,
    from the first token to the last; the speedup compares the same request run with Auto."""
    stats = run.stats
    assert stats is not None
    line = f"{stats.new_tokens} tokens, {stats.decode_tokens_per_second:.1f} tokens/s"
    line += f", tau {stats.mean_accepted_length:.2f}"
    if auto is not None and auto.stats is not None and auto.stats.decode_tokens_per_second > 0:
        speedup = stats.decode_tokens_per_second / auto.stats.decode_tokens_per_second
        same = "same tokens" if auto.token_ids == run.token_ids else "different tokens"
        line += f", {speedup:.2f}x Auto ({auto.stats.decode_tokens_per_second:.1f} tokens/s, {same})"
    return line
