"""Auto vs EAGLE-3 vs DiffSpec, paired on the same prompts, in one run.

For every context length, every prompt is truncated (keeping its end, so it still stops
mid-file) and generated with each configuration in turn on one engine. Reported per config
and length: tau (mean accepted length), decode tokens/s, its ratio to Auto's on the same
prompts, draft seconds per step and the draft's working-set size. Greedy outputs are also
checked against Auto's (speculation must not change a token).

    python -m bench.paired --base-model ../shared/models/bench-code --draft-model HEAD \
        --data ../shared/data/longctx_eval.jsonl --lengths 4096 16384 32768 65536 --out bench/results/x.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.warmup import warm_up_target
from diffspec.settings import DiffSpecSettings
from draft_service.backend import DraftOptions
from gateway.assembly import build_engine
from gateway.engine import SpeculativeEngine
from gateway.request import GenerationRequest, GenerationStats

CONFIGS = {
    "auto": None,
    "chain": DraftOptions("chain", "64:0.0:8", salience=False),
    "eagle3": DraftOptions("full", "64:0.0:8", salience=False),
    "eagle3+salience": DraftOptions("full", "64:0.0:8", salience=True),
    "diffspec": DraftOptions("online", "64:0.0:8", salience=True),
}


@dataclass
class Run:
    config: str
    length: int
    prompt: int
    token_ids: list[int]
    stats: GenerationStats


async def generate(engine: SpeculativeEngine, ids: list[int], options: DraftOptions | None, n: int) -> Run:
    tokens: list[int] = []
    stats = None
    async for chunk in engine.generate(GenerationRequest(ids, n, draft=options)):
        tokens += chunk.token_ids
        stats = chunk.stats or stats
    assert stats is not None
    return Run("", len(ids), 0, tokens, stats)


def summarise(runs: list[Run], configs: list[str]) -> list[dict]:
    rows = []
    for length in sorted({r.length for r in runs}):
        at = [r for r in runs if r.length == length]
        auto = [r for r in at if r.config == "auto"]
        auto_tps = sum(r.stats.new_tokens - 1 for r in auto) / sum(r.stats.decode_seconds for r in auto) if auto else 0
        for config in configs:
            mine = [r for r in at if r.config == config]
            steps = sum(r.stats.steps for r in mine)
            tps = sum(r.stats.new_tokens - 1 for r in mine) / sum(r.stats.decode_seconds for r in mine)
            rows.append(
                {
                    "config": config,
                    "context": length,
                    "prompts": len(mine),
                    "tau": round(sum(r.stats.accepted_drafts + r.stats.steps for r in mine) / steps, 3),
                    "decode_tokens_per_s": round(tps, 2),
                    "speedup_vs_auto": round(tps / auto_tps, 3) if auto_tps else None,
                    "draft_ms_per_step": round(1000 * sum(r.stats.draft_seconds for r in mine) / steps, 3),
                    "verify_ms_per_step": round(1000 * sum(r.stats.verify_seconds for r in mine) / steps, 3),
                    "working_set_tokens": max(r.stats.working_set_tokens for r in mine),
                    "matches_auto": all(
                        r.token_ids == a.token_ids for r in mine for a in auto if a.prompt == r.prompt
                    ),
                }
            )
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == config]
        xs = [r["context"] for r in mine]
        axes[0].plot(xs, [r["tau"] for r in mine], marker="o", label=config)
        axes[1].plot(xs, [r["speedup_vs_auto"] for r in mine], marker="o", label=config)
        axes[2].plot(xs, [r["draft_ms_per_step"] for r in mine], marker="o", label=config)
    for ax, title in zip(axes, ["tau (accepted + bonus per step)", "decode speedup vs Auto", "draft ms per step"]):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-model", type=Path, required=True)
    parser.add_argument("--draft-model", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True, help="JSONL with a 'text' field per prompt")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--configs", nargs="+", default=["auto", "eagle3", "eagle3+salience", "diffspec"], choices=list(CONFIGS))
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton", "flash-attn"])
    parser.add_argument("--working-set-tokens", type=int, default=2048)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    settings = DiffSpecSettings(
        base_model=args.base_model,
        draft_model=args.draft_model,
        num_pages=(max(args.lengths) + 4 * args.max_new_tokens) // 16 * 2 + 64,
        attention_backend=args.attention_backend,
        working_set_tokens=args.working_set_tokens,
    )
    engine = build_engine(settings)
    texts = [json.loads(line)["text"] for line in args.data.read_text().splitlines()[: args.prompts]]
    encoded = [engine.tokenizer(t)["input_ids"] for t in texts]
    print(f"recorded {warm_up_target(engine)} step graphs", flush=True)
    runs: list[Run] = []
    for length in args.lengths:
        prompts = [ids[:1] + ids[1:][-(length - 1) :] for ids in encoded]  # keep <|bos|> and the end of the text
        for config in args.configs:  # draft graphs are per context capacity: record them outside the timed runs
            asyncio.run(generate(engine, prompts[0], CONFIGS[config], 32))
        for p, prompt in enumerate(prompts):
            for config in args.configs:
                started = time.perf_counter()
                run = asyncio.run(generate(engine, prompt, CONFIGS[config], args.max_new_tokens))
                run.config, run.prompt, run.length = config, p, length  # label by the length asked for
                runs.append(run)
                print(
                    f"[{len(runs)}/{len(args.lengths) * len(encoded) * len(args.configs)}] ctx={length} prompt={p} "
                    f"{config}: tau={run.stats.mean_accepted_length:.2f} "
                    f"decode={run.stats.decode_tokens_per_second:.1f} tok/s ({time.perf_counter() - started:.1f}s)",
                    flush=True,
                )
    rows = summarise(runs, args.configs)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    result = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d"),
        "device": device,
        "rows": rows,
        "runs": [{"config": r.config, "context": r.length, "prompt": r.prompt, "stats": r.stats.to_dict()} for r in runs],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(rows, args.out.with_suffix(".png"))
    print(f"{'config':18} {'ctx':>6} {'tau':>6} {'tok/s':>8} {'vs auto':>8} {'draft ms':>9} {'ws':>6} same")
    for r in rows:
        print(
            f"{r['config']:18} {r['context']:6} {r['tau']:6.2f} {r['decode_tokens_per_s']:8.1f} "
            f"{r['speedup_vs_auto'] or 0:8.2f} {r['draft_ms_per_step']:9.2f} {r['working_set_tokens']:6} {r['matches_auto']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
