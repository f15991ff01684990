"""What ``diffspec generate`` prints for n samples and logprobs, from chunks as an engine streams them."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

from cli.output import show, summary_line
from diffspec.sampling_params import TokenLogprobs
from gateway.request import GenerationChunk, GenerationStats


def stats(new_tokens: int) -> GenerationStats:
    return GenerationStats(prompt_tokens=3, new_tokens=new_tokens, steps=1, decode_seconds=1.0, finish_reason="length")


def logprobs(*values: float) -> TokenLogprobs:
    return TokenLogprobs(list(values), [[7] for _ in values], [[-0.1] for _ in values])


# two samples, interleaved as generate_samples merges them
CHUNKS = [
    GenerationChunk([], "", prefill_progress=(3, 3)),
    GenerationChunk([5], "a", logprobs=logprobs(-1.0), index=0),
    GenerationChunk([6], "b", logprobs=logprobs(-2.0), index=1),
    GenerationChunk([8, 9], "cd", logprobs=logprobs(-3.0, -4.0), index=1),
    GenerationChunk([], "!", stats=stats(1), index=0),
    GenerationChunk([], "", stats=stats(3), index=1),
]


async def stream() -> AsyncIterator[GenerationChunk]:
    for chunk in CHUNKS:
        yield chunk


def test_json_lines_carry_the_index_and_each_sample_ends_with_its_whole_line(capsys):
    samples = asyncio.run(show(stream(), as_json=True, num_samples=2))
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["index"] for line in lines] == [0, 1, 1, 0, 1]
    assert lines[1]["logprobs"] == {"logprobs": [-2.0], "top_ids": [[7]], "top_logprobs": [[-0.1]]}
    last_0, last_1 = lines[3], lines[4]
    assert (last_0["token_ids"], last_0["text"], last_0["stats"]["new_tokens"]) == ([5], "a!", 1)
    assert (last_1["token_ids"], last_1["text"]) == ([6, 8, 9], "bcd")
    assert last_1["logprobs"]["logprobs"] == [-2.0, -3.0, -4.0]
    assert [s.token_ids for s in samples] == [[5], [6, 8, 9]]


def test_text_prints_each_sample_whole_under_a_header_once_it_ends(capsys):
    samples = asyncio.run(show(stream(), as_json=False, num_samples=2))
    assert capsys.readouterr().out == "--- sample 0 ---\na!\n--- sample 1 ---\nbcd\n"
    assert summary_line(samples[1]).startswith("3 tokens, 2.0 tokens/s, tau 1.00")


def test_one_sample_streams_its_text_and_json_lines_stay_untagged(capsys):
    one = [GenerationChunk([5], "a"), GenerationChunk([6], "b"), GenerationChunk([], "", stats=stats(2))]

    async def single() -> AsyncIterator[GenerationChunk]:
        for chunk in one:
            yield chunk

    asyncio.run(show(single(), as_json=True))
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0] == {"token_ids": [5], "text": "a"} and set(lines[-1]) == {"token_ids", "text", "stats"}
    asyncio.run(show(single(), as_json=False))
    assert capsys.readouterr().out == "ab\n"
