"""Where the engine loop's time goes: cProfile of the loop's thread while concurrent streams run.

Every model call runs on the engine thread, so one profile of that thread holds the whole
iteration: the draft call, the target call and the loop's own host work. A GPU's queued work
shows up at the calls that wait for it (a tensor read back to the host). Each mode runs once
untimed first, so graph recording stays out of the profile.

    python -m bench.profile_generation --base-model .carry/b8/target --draft-model .carry/b8/head \
        --data .carry/data/shortctx_eval.jsonl --streams 16 --modes full-16 > bench/results/profile_engine.txt
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import sys
from pathlib import Path

from bench.batching import MODES, concurrent
from diffspec.settings import DiffSpecSettings
from gateway.assembly import build_engine
from gateway.engine_core import EngineCore


def profiled_loop(core: EngineCore, profile: cProfile.Profile) -> None:
    """Run ``core``'s iterations under ``profile`` while it has work (this thread stands in for the loop's)."""
    while core.has_work():
        profile.runcall(core.step)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-model", type=Path, required=True)
    parser.add_argument("--draft-model", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--modes", nargs="+", default=["full-16"], choices=list(MODES))
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rows", type=int, default=30, help="functions listed per profile")
    args = parser.parse_args()
    settings = DiffSpecSettings(base_model=args.base_model, draft_model=args.draft_model, num_pages=8192)
    engine = build_engine(settings)
    engine.core.close()  # the loop runs in this thread instead, under the profiler
    texts = [json.loads(line)["text"] for line in args.data.read_text().splitlines()[: args.streams]]
    prompts = [engine.tokenizer(t)["input_ids"][-args.prompt_tokens :] for t in texts]
    for mode in args.modes:
        for profile in (cProfile.Profile(), cProfile.Profile()):  # the first run records graphs, untimed
            asyncio.run(_run(engine, prompts, mode, args.max_new_tokens, profile))
        print(f"==== {mode}, {args.streams} streams, {args.max_new_tokens} new tokens each ====")
        for order in ("tottime", "cumulative"):
            pstats.Stats(profile, stream=sys.stdout).sort_stats(order).print_stats(args.rows)
    return 0


async def _run(engine, prompts, mode: str, max_new_tokens: int, profile: cProfile.Profile) -> None:  # noqa: ANN001
    streams = asyncio.ensure_future(concurrent(engine, prompts, MODES[mode], max_new_tokens))
    await asyncio.sleep(0.05)  # every request is in the inbox
    await asyncio.to_thread(profiled_loop, engine.core, profile)
    await streams


if __name__ == "__main__":
    sys.exit(main())
