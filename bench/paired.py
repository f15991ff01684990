"""Auto vs EAGLE-3 vs DiffSpec with fixed configurations, paired on the same prompts, in one run.

A quick comparison without the tuning pass of ``python -m bench.reproduce`` (which also replays
divergences to tell near-ties from bugs): for every context length every prompt is cut to that
length (keeping its end) and generated with each configuration in turn on one engine, Auto first.
Reported per configuration and length: tau, decode-only and end-to-end tokens/s and their ratios to
Auto's, the draft / verify / host split of a step, the working set, and whether greedy outputs equal
Auto's (a divergence here is only counted; ``bench.reproduce`` judges it); the JSON also keeps each
run's trees (tokens, depth, where the accepted path stopped), which say what ``online`` chose, and per
``online`` bound what the batch planner predicted against what the run's steps delivered (printed too). With
``--temperature`` above 0 every configuration samples, each prompt with its own seed, and is compared with
Auto's sampled output too: the token at each index takes that index's uniform whatever the trees
(``diffspec/acceptance.py``).

    python -m bench.paired --base-model ../shared/models/bench-code --draft-model HEAD \
        --data ../shared/data/longctx_eval.jsonl --lengths 4096 16384 32768 65536 --out bench/results/x.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import get_args

from bench.bound_audits import audit_lines
from bench.reproduce.arms import BASELINE_TREE_CONFIG, DIFFSPEC, Arm, baseline_arms, diffspec_arm
from bench.reproduce.draft_steps import build_recording_engine, take_draft_steps
from bench.reproduce.exactness import ExactnessResult, first_divergence
from bench.reproduce.output import device_name
from bench.reproduce.plots import plot_summaries
from bench.reproduce.prompts import Dataset, load_datasets, prompts_at
from bench.reproduce.report import markdown, summarise, to_dicts
from bench.reproduce.runs import Engine, RunRecord, generate_run
from bench.warmup import warm_up_draft, warm_up_draft_over, warm_up_generations, warm_up_target
from diffspec.errors import InvalidRequest
from diffspec.heap import startup_heap_frozen
from diffspec.sampling_params import SamplingParams
from diffspec.settings import DiffSpecSettings, DraftQuantization
from draft_service.tree_budget import TreeBudget
from gateway.assembly import load_tokenizer


def arms_at(tree_config: str) -> dict[str, Arm]:
    """Every configuration ``--configs`` names, each drafting within ``tree_config``."""
    return {**baseline_arms(tree_config), DIFFSPEC: diffspec_arm("online", tree_config)}


ARMS = arms_at(BASELINE_TREE_CONFIG)


def tree_config_arg(text: str) -> str:
    """``--tree-config``: a tree budget as ``TreeBudget.parse`` reads it, or argparse's error naming the flag."""
    try:
        return TreeBudget.parse(text).config
    except InvalidRequest as bad:
        raise argparse.ArgumentTypeError(str(bad)) from None


def compared(auto: RunRecord, run: RunRecord) -> ExactnessResult:
    """Equal or not; no replay, so a divergence is listed as unchecked rather than judged."""
    divergence = first_divergence(auto.token_ids, run.token_ids)
    if divergence is None:
        return ExactnessResult("exact", "same tokens as Auto")
    return ExactnessResult("unchecked", "diverges from Auto; run bench.reproduce to judge it", divergence)


def sampling_for(temperature: float, prompt: int) -> SamplingParams:
    """Greedy at 0; above it, seeded by the prompt's index, the same seed for every configuration."""
    return SamplingParams(temperature=temperature, seed=prompt) if temperature > 0 else SamplingParams()


async def run_all(
    engine: Engine,
    dataset: Dataset,
    lengths: list[int],
    prompts: int,
    arms: list[Arm],
    n: int,
    temperature: float = 0.0,
    same_prompts: bool = False,
) -> list[RunRecord]:
    """Every arm on each length's prompts; with ``same_prompts`` every length takes the prompts long enough for
    the longest, so a ratio across lengths compares the same texts."""
    runs: list[RunRecord] = []
    total = len(lengths) * prompts * len(arms)
    long_enough_for = max(lengths) if same_prompts else None
    for length in lengths:
        chosen = prompts_at(dataset, length, 0, prompts, long_enough_for)
        # draft graphs are per context capacity: record them outside the timed runs (on another prompt
        # than the evaluated ones where there is one, so Auto's timed prefill finds no cached pages)
        warm = prompts_at(dataset, length, chosen[-1][0] + 1, 1, long_enough_for) or chosen
        await warm_up_generations(engine, warm[0][1], [a.draft for a in arms], 32)
        warm_up_draft_over(engine, length, n)  # and every tree an online session may reach, at this context
        take_draft_steps(engine)  # the warm-up's trees belong to no run
        for index, ids in chosen:
            for arm in arms:
                run = await generate_run(engine, ids, arm, n, sampling_for(temperature, index))
                run.phase, run.dataset, run.context, run.prompt = "eval", dataset.name, length, index
                runs.append(run)
                print(f"[{len(runs)}/{total}] ctx={length} prompt={index} {arm.label}: "
                      f"tau={run.stats.mean_accepted_length:.2f} decode={run.stats.decode_tokens_per_second:.1f} tok/s",
                      *audit_lines(arm.label, run.online_bound_audit), sep="\n", flush=True)
    auto = {(r.context, r.prompt): r for r in runs if r.arm == "auto"}
    for run in runs:
        if run.arm != "auto" and (run.context, run.prompt) in auto:
            run.exactness = compared(auto[(run.context, run.prompt)], run)
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-model", type=Path, required=True)
    parser.add_argument("--draft-model", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True, help="JSONL with a 'text' field per prompt, or a plain file")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--configs", nargs="+", default=["auto", "eagle3", "eagle3+salience", "diffspec"], choices=list(ARMS))
    # the settings' flags default to None: a DIFFSPEC_* variable then sets them, as it sets every other setting
    parser.add_argument("--attention-backend", choices=["auto", "torch", "triton", "flash-attn"],
                        help="(DIFFSPEC_ATTENTION_BACKEND)")
    parser.add_argument("--working-set-tokens", type=int, help="(DIFFSPEC_WORKING_SET_TOKENS)")
    parser.add_argument("--tree-config", default=BASELINE_TREE_CONFIG, type=tree_config_arg,
                        help="the tree budget total_tokens:threshold:depth every speculative configuration drafts within")
    parser.add_argument("--draft-quantization", choices=get_args(DraftQuantization),
                        help="the draft head's per-depth matmuls (DIFFSPEC_DRAFT_QUANTIZATION)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample above 0 (seeded per prompt; outputs not compared), greedy at 0")
    parser.add_argument("--same-prompts", action="store_true",
                        help="every length takes the prompts long enough for the longest (the same texts, cut)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.temperature < 0:
        parser.error("--temperature must be at least 0")

    flags = {"attention_backend": args.attention_backend, "working_set_tokens": args.working_set_tokens,
             "draft_quantization": args.draft_quantization}  # fmt: skip
    settings = DiffSpecSettings(
        base_model=args.base_model,
        draft_model=args.draft_model,
        num_pages=(max(args.lengths) + 4 * args.max_new_tokens) // 16 * 2 + 64,
        **{name: value for name, value in flags.items() if value is not None},
    )
    tokenizer = load_tokenizer(settings)
    dataset = load_datasets([args.data], lambda text: tokenizer(text)["input_ids"])[0]
    engine = build_recording_engine(settings)  # each run keeps its trees (sizes, depths, stops) in the results
    # as a server warms before traffic: step graphs, the trees an online session starts from, the verify costs
    # seeded into the draft's cost model; else the first online request compiles and measures in a timed run
    print(f"recorded {warm_up_target(engine)} step graphs, proposed {warm_up_draft(engine)} warm-up trees", flush=True)
    named = arms_at(args.tree_config)
    arms = [named["auto"]] + [named[c] for c in args.configs if c != "auto"]  # Auto first: cold prefill
    with startup_heap_frozen():  # as a server's heap is once it is up (diffspec/heap.py)
        runs = asyncio.run(
            run_all(engine, dataset, args.lengths, args.prompts, arms, args.max_new_tokens, args.temperature,
                    args.same_prompts)
        )
    summaries = summarise(runs)
    result = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d"),
        "device": device_name(),
        # every engine setting, those from DIFFSPEC_* variables included: the command alone does not say them
        "settings": json.loads(settings.model_dump_json()),
        "summaries": to_dicts(summaries),
        "runs": [r.to_dict() for r in runs],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot_summaries(summaries, args.out.parent, prefix=f"{args.out.stem}_")
    print(markdown(summaries, [], f"# {args.out.name}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
