"""Time to the first token of a drafting request whose prompt its client sent before, against the same request cold,
side by side on one engine (the draft's prefix cache and the target's: ``draft_service/prefix_cache.py``).

For each prompt cut to its last ``--prompt-tokens`` tokens, each request a client of its own unless said:
Auto cold; DiffSpec cold; DiffSpec again as the same client (both caches hold the prompt); and a next turn, the
prompt, that answer and ``--turn-tokens`` more of the text's tokens, cold and as that client. Reported per prompt:
each request's first-token and request seconds and the entries its draft found cached, the warm/cold ratios, and
whether the warm requests' tokens equal the cold ones'.

The draft's cache holds as many entries as the target's pool holds tokens (serving's default) unless
``--draft-cache-tokens`` says otherwise: one that holds a single 64K conversation loses the warm client's chain to
the cold next turn (another client's prompt) before the warm next turn comes.

    python -m bench.prefix_reuse --base-model B8/target --draft-model B8/head --data longctx_eval.jsonl \\
        --prompt-tokens 65536 --prompts 2 --out bench/results/prefix_reuse.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from pathlib import Path

from bench.reproduce.arms import Arm
from bench.reproduce.runs import generate_run
from bench.warmup import in_process_draft, warm_up_draft, warm_up_target
from diffspec.heap import startup_heap_frozen
from diffspec.settings import DiffSpecSettings
from draft_service.options import DraftOptions
from gateway.assembly import build_engine
from gateway.engine import SpeculativeEngine

AUTO = Arm("auto", None)
DIFFSPEC = Arm("diffspec", DraftOptions("online", "16:0.0:6", salience=True))


def timed(engine: SpeculativeEngine, ids: list[int], arm: Arm, client: str | None, n: int) -> dict:
    """One greedy request as ``client`` (None: a client of its own, cold; ``generate_run``): its tokens,
    first-token and request seconds, and the prompt entries its draft's lookup found cached."""
    cache = in_process_draft(engine).prefix_cache
    hits_before = cache.hit_entries
    run = asyncio.run(generate_run(engine, ids, arm, n, cache_scope=client))
    seconds = {"first_token_s": round(run.first_token_seconds, 4), "request_s": round(run.request_seconds, 4)}
    return {"tokens": run.token_ids, **seconds, "draft_cached_entries": cache.hit_entries - hits_before}


def one_prompt(engine: SpeculativeEngine, ids: list[int], turn: list[int], n: int) -> dict:
    client = f"reuse-{uuid.uuid4().hex}"
    auto = timed(engine, ids, AUTO, None, n)
    cold = timed(engine, ids, DIFFSPEC, client, n)
    warm = timed(engine, ids, DIFFSPEC, client, n)
    next_turn = [*ids, *warm["tokens"], *turn]
    turn_cold = timed(engine, next_turn, DIFFSPEC, None, n)
    turn_warm = timed(engine, next_turn, DIFFSPEC, client, n)
    return {
        "prompt_tokens": len(ids), "next_turn_tokens": len(next_turn),
        "runs": {name: {k: v for k, v in run.items() if k != "tokens"}
                 for name, run in [("auto", auto), ("cold", cold), ("warm", warm), ("turn_cold", turn_cold),
                                   ("turn_warm", turn_warm)]},
        "warm_over_cold_first_token": round(warm["first_token_s"] / cold["first_token_s"], 4),
        "turn_warm_over_cold_first_token": round(turn_warm["first_token_s"] / turn_cold["first_token_s"], 4),
        "cold_equals_auto": cold["tokens"] == auto["tokens"],
        "warm_equals_cold": warm["tokens"] == cold["tokens"],
        "turn_warm_equals_cold": turn_warm["tokens"] == turn_cold["tokens"],
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-model", type=Path, required=True)
    parser.add_argument("--draft-model", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--prompt-tokens", type=int, default=65536)
    parser.add_argument("--turn-tokens", type=int, default=64, help="the next turn's new tokens")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-pages", type=int, default=16384)
    parser.add_argument("--draft-cache-tokens", type=int, default=-1,
                        help="entries the draft's prefix cache holds (default -1: the target pool's tokens)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.draft_cache_tokens == 0:
        parser.error("--draft-cache-tokens 0 turns off the draft's prefix cache, which this benchmark measures")
    engine = build_engine(DiffSpecSettings(base_model=args.base_model, draft_model=args.draft_model,
                                           num_pages=args.num_pages, draft_prefix_cache_tokens=args.draft_cache_tokens))
    try:
        graphs, trees = warm_up_target(engine), warm_up_draft(engine)
        print(f"recorded {graphs} step graphs, proposed {trees} warm-up trees", flush=True)
        texts = [json.loads(line)["text"] for line in args.data.read_text().splitlines()]
        needed = args.prompt_tokens + args.turn_tokens
        encoded = [ids for ids in (engine.tokenizer(t)["input_ids"] for t in texts) if len(ids) >= needed]
        rows = []
        with startup_heap_frozen():  # as a server's heap is once it is up (diffspec/heap.py)
            for ids in encoded[: args.prompts]:
                prompt, turn = ids[-needed : -args.turn_tokens], ids[-args.turn_tokens :]
                rows.append(one_prompt(engine, prompt, turn, args.max_new_tokens))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        engine.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"prompt_tokens": args.prompt_tokens, "policy": "online 16:0.0:6 salience",
                                    "prompts": rows}, indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
