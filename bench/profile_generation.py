"""Where a generation's host time goes: cProfile of one Auto, one DiffSpec and one EAGLE-3 generation.

The engine hands model work to threads (``asyncio.to_thread``), which cProfile does not follow,
so this tool runs that work inline in the profiled thread instead; the tokens are the same, the
timings are of one thread doing everything.

    python -m bench.profile_generation --base-model ../shared/models/bench-code --draft-model HEAD \
        --data ../shared/data/longctx_eval.jsonl --length 4096 > bench/results/profile_generation_4k.txt
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

from bench.paired import CONFIGS, generate
from diffspec.settings import DiffSpecSettings
from gateway.assembly import build_engine


async def _inline(function, *args, **kwargs):
    return function(*args, **kwargs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-model", type=Path, required=True)
    parser.add_argument("--draft-model", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True, help="JSONL with a 'text' field; the first prompt is used")
    parser.add_argument("--length", type=int, default=4096, help="prompt tokens (the end of the text)")
    parser.add_argument("--configs", nargs="+", default=["auto", "diffspec", "eagle3"], choices=list(CONFIGS))
    parser.add_argument("--rows", type=int, default=22, help="functions listed per profile")
    args = parser.parse_args()
    asyncio.to_thread = _inline  # profile the model work in this thread
    engine = build_engine(DiffSpecSettings(base_model=args.base_model, draft_model=args.draft_model,
                                           num_pages=2 * args.length // 16 + 512))  # fmt: skip
    ids = engine.tokenizer(json.loads(args.data.read_text().splitlines()[0])["text"])["input_ids"]
    ids = ids[:1] + ids[1:][-(args.length - 1) :]
    for name in args.configs:
        asyncio.run(generate(engine, ids, CONFIGS[name], 32))  # warm-up: Triton compiles, graphs record
        profile = cProfile.Profile()
        started = time.perf_counter()
        profile.enable()
        run = asyncio.run(generate(engine, ids, CONFIGS[name], 128))
        profile.disable()
        s = run.stats
        print(f"== {name}: {time.perf_counter() - started:.2f}s steps {s.steps} decode {s.decode_seconds:.3f}s "
              f"draft {s.draft_seconds:.3f}s verify {s.verify_seconds:.3f}s", flush=True)  # fmt: skip
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
