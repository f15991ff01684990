"""Where accepted paths stop: empirical hazard and survival per depth, per tree policy.

For each policy, every prompt is generated (temperature 0) and the per-step stop depths are
pooled. Depth d's hazard is (steps that stopped at d) / (steps that reached d); a step whose
path ran to the tree's last depth is censored there. The plot shows h(d) and S(d) per policy,
which is what the online policy's budget rule spends its width and depth on.

    python -m bench.hazard_analysis --data ../shared/data/shortctx_eval.jsonl --prompts 16 \
        --out bench/results/hazard_tiny.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from diffspec.settings import DiffSpecSettings
from draft_service.backend import DraftOptions
from gateway.assembly import build_engine
from gateway.engine import SpeculativeEngine
from gateway.request import GenerationRequest

POLICIES = {
    "chain": DraftOptions("chain", "64:0.0:8"),
    "uniform2": DraftOptions("uniform2", "64:0.0:8"),
    "full": DraftOptions("full", "64:0.0:8"),
}  # fixed-depth trees only: a step that accepts all 8 drafts is censored, never a stop
DEPTH = 8


async def stop_depths(engine: SpeculativeEngine, ids: list[int], options: DraftOptions, n: int) -> list[int]:
    stats = None
    async for chunk in engine.generate(GenerationRequest(ids, n, draft=options)):
        stats = chunk.stats or stats
    assert stats is not None
    return stats.stop_depth_histogram


def hazard_curve(histogram: list[int], depth: int) -> tuple[list[float], list[float]]:
    """(h(d), S(d)) for d = 1..depth from a pooled stop-depth histogram; stops at ``depth`` are censored."""
    counts = histogram + [0] * (depth + 1 - len(histogram))
    reached = sum(counts)
    hazards, survival = [], []
    for d in range(depth):  # a path "stops at depth d + 1" when exactly d drafts were accepted
        survival.append(reached / max(1, sum(counts)))
        hazards.append(counts[d] / reached if reached else 0.0)
        reached -= counts[d]
    return hazards, survival


def plot(curves: dict[str, tuple[list[float], list[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, (hazards, survival) in curves.items():
        depths = list(range(1, len(hazards) + 1))
        left.plot(depths, hazards, marker="o", label=name)
        right.plot(depths, survival, marker="o", label=name)
    left.set_title("hazard h(d) = P(stop at d | reached d)")
    right.set_title("survival S(d) = P(reach d)")
    for ax in (left, right):
        ax.set_xlabel("draft depth d")
        ax.grid(alpha=0.3)
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    engine = build_engine(DiffSpecSettings())
    texts = [json.loads(line)["text"] for line in args.data.read_text().splitlines()[: args.prompts]]
    prompts = [engine.tokenizer(t)["input_ids"] for t in texts]
    pooled: dict[str, list[int]] = {}
    for name, options in POLICIES.items():
        total = [0] * (DEPTH + 1)
        for i, ids in enumerate(prompts):
            for depth, count in enumerate(asyncio.run(stop_depths(engine, ids, options, args.max_new_tokens))):
                total[depth] += count
            print(f"{name}: prompt {i + 1}/{len(prompts)}", file=sys.stderr, flush=True)
        pooled[name] = total
    curves = {name: hazard_curve(histogram, DEPTH) for name, histogram in pooled.items()}
    result = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d"),
        "device": "cpu",
        "stop_depth_histograms": pooled,
        "hazard": {name: [round(h, 4) for h in curve[0]] for name, curve in curves.items()},
        "survival": {name: [round(s, 4) for s in curve[1]] for name, curve in curves.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(curves, args.out.with_suffix(".png"))
    for name in POLICIES:
        print(name, "h:", result["hazard"][name], "\n      S:", result["survival"][name])
    return 0


if __name__ == "__main__":
    sys.exit(main())
