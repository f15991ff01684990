"""What continuous batching buys: aggregate tokens/s with 1, 4 and 16 concurrent streams.

Every stream is a full generation through the in-process engine (prefill, then Auto decode
or speculative steps); the target coalesces the concurrent sessions' decode/verify steps into
one forward. Reported: total generated tokens over wall time, and per-forward batch sizes.

    python -m bench.batching --base-model ../shared/models/bench-code --draft-model HEAD \
        --data ../shared/data/shortctx_eval.jsonl --out bench/results/batching.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.warmup import warm_up_target
from diffspec.settings import DiffSpecSettings
from draft_service.backend import DraftOptions
from gateway.assembly import build_engine
from gateway.engine import SpeculativeEngine
from gateway.request import GenerationRequest

MODES = {"auto": None, "diffspec": DraftOptions("full", "32:0.0:6")}


async def one_stream(engine: SpeculativeEngine, ids: list[int], options: DraftOptions | None, n: int) -> int:
    count = 0
    async for chunk in engine.generate(GenerationRequest(ids, n, draft=options)):
        count += len(chunk.token_ids)
    return count


async def concurrent(engine: SpeculativeEngine, prompts: list[list[int]], options, n: int) -> tuple[int, float]:
    started = time.perf_counter()
    counts = await asyncio.gather(*(one_stream(engine, ids, options, n) for ids in prompts))
    return sum(counts), time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-model", type=Path, required=True)
    parser.add_argument("--draft-model", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton", "flash-attn"])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    engine = build_engine(
        DiffSpecSettings(base_model=args.base_model, draft_model=args.draft_model, num_pages=8192,
                         attention_backend=args.attention_backend)
    )
    texts = [json.loads(line)["text"] for line in args.data.read_text().splitlines()[: max(args.streams)]]
    prompts = [engine.tokenizer(t)["input_ids"][-args.prompt_tokens :] for t in texts]
    print(f"recorded {warm_up_target(engine)} step graphs", flush=True)
    for options in MODES.values():
        asyncio.run(concurrent(engine, prompts[:1], options, 8))  # warm-up
    rows = []
    for mode, options in MODES.items():
        for streams in args.streams:
            batcher = engine.target.batcher
            batcher.batch_sizes.clear()
            tokens, seconds = asyncio.run(concurrent(engine, prompts[:streams], options, args.max_new_tokens))
            rows.append({
                "mode": mode, "streams": streams, "tokens": tokens, "seconds": round(seconds, 3),
                "tokens_per_s": round(tokens / seconds, 1),
                "mean_sessions_per_forward": round(statistics.mean(batcher.batch_sizes), 2),
            })
            print(json.dumps(rows[-1]), flush=True)
    for row in rows:
        single = next(r for r in rows if r["mode"] == row["mode"] and r["streams"] == min(args.streams))
        row["vs_one_stream"] = round(row["tokens_per_s"] / single["tokens_per_s"], 2)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "device": device, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
