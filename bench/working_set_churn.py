"""How often the salience working set changes, and what its freshness buys, per re-selection setting.

Each change of the working set is an arena update in the accept that makes it (a host upload and a few
indexed copies per decoder layer, on the step's critical path at small batches). Re-selecting less often
saves those; a staler set may lose acceptance. For each (``min_overlap``, ``reselect_every``) setting
this generates the same prompts with the `full` tree over the working set and reports tau (accepted
drafts + 1 per step) and working-set changes per step, from each request's own stats. The counts depend
on the model's outputs, not on the machine: a CPU run measures them as a GPU run would.

    python -m bench.working_set_churn --base-model ../shared/models/bench-code \
        --draft-model ../shared/models/bench-code-eagle3 --contexts 4096 16384 --prompts 4 \
        --settings 0.75:8 0.5:8 0:8 0:4 --out bench/results/working_set_churn_benchcode.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from diffspec.settings import SHARED_DIR, DiffSpecSettings
from draft_service.options import DraftOptions
from gateway.assembly import build_engine, load_tokenizer
from gateway.request import GenerationRequest, GenerationStats


def parse_setting(text: str) -> tuple[float, int]:
    """'min_overlap:reselect_every', e.g. '0.75:8'."""
    overlap, every = text.split(":")
    return float(overlap), int(every)


async def generate(engine, ids: list[int], max_new_tokens: int, options: DraftOptions) -> GenerationStats:  # noqa: ANN001
    stats = None
    async for chunk in engine.generate(GenerationRequest(ids, max_new_tokens, draft=options)):
        stats = chunk.stats or stats
    assert stats is not None, "the last chunk carries the stats"
    return stats


def measure(settings: DiffSpecSettings, prompts: dict[int, list[list[int]]], max_new_tokens: int, tree: str) -> list[dict]:
    """One row per context: tau and working-set changes per step over its prompts."""
    engine = build_engine(settings)
    rows = []
    try:
        for context, context_prompts in prompts.items():
            runs = [asyncio.run(generate(engine, ids, max_new_tokens, DraftOptions("full", tree, salience=True)))
                    for ids in context_prompts]
            steps = sum(s.steps for s in runs)
            rows.append({
                "min_overlap": settings.salience_min_overlap, "reselect_every": settings.salience_reselect_every,
                "context": context, "prompts": len(runs), "steps": steps,
                "tau": round(sum(s.accepted_drafts + s.steps for s in runs) / steps, 3),
                "working_set_changes_per_step": round(sum(s.working_set_updates for s in runs) / steps, 3),
            })
            print(json.dumps(rows[-1]), flush=True)
    finally:
        engine.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-model", type=Path, required=True)
    parser.add_argument("--draft-model", type=Path, required=True)
    parser.add_argument("--data", type=Path, default=SHARED_DIR / "data" / "longctx_eval.jsonl")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--tree-config", default="64:0.0:8")
    parser.add_argument("--settings", type=parse_setting, nargs="+", default=[(0.75, 8)],
                        help="min_overlap:reselect_every pairs")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    base = DiffSpecSettings(base_model=args.base_model, draft_model=args.draft_model)
    tokenizer = load_tokenizer(base)
    texts = [json.loads(line)["text"] for line in args.data.read_text().splitlines()[: args.prompts]]
    prompts = {c: [tokenizer(text)["input_ids"][-c:] for text in texts] for c in args.contexts}
    pages = 2 * (max(args.contexts) + args.max_new_tokens + 256) // base.page_size + 64
    rows = []
    for overlap, every in args.settings:
        settings = base.model_copy(update={"salience_min_overlap": overlap, "salience_reselect_every": every,
                                           "num_pages": max(base.num_pages, pages)})
        rows += measure(settings, prompts, args.max_new_tokens, args.tree_config)
    args.out.write_text(json.dumps({"command": "python -m bench.working_set_churn " + " ".join(argv),
                                    "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
