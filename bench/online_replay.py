"""The ``online`` policy beside ``full`` along the target's own text, priced by a frozen GPU cost model (on a CPU).

The ``online`` policy chooses its trees from measured costs, so on a CPU, where a verify is compute-bound from
a few tokens, it chooses what no GPU would. Here the draft runtime's cost model is replaced by a frozen one
(``FrozenCost``: verify milliseconds by tree tokens, proposal milliseconds by depth, a step's overhead, as a GPU
measured them; the defaults are an H100's at 64K with the 8B-shaped pair, from the bound audits of
``paired_64k_deep_32_0.0_10_recheck_h100.json.gz``) and the runtime steps along each prompt's greedy
continuation, as ``bench.forced_acceptance`` drafts: a proposal from each root, the tree's longest path the
continuation follows accepted, the continuation's next token the bonus. Every arm of every prompt runs on one
runtime, in order, as ``bench.paired`` runs them: what a request leaves to the next (the global estimates, the
batch's bound) is part of what is measured. Each step is priced by the frozen model at the depths its proposal
ran and the tree tokens it verified; the tokens per second it predicts are that model's, not a measurement.
Each run keeps its steps (``per_step``: the tree, its nodes, the depths run, the tokens emitted), so which trees
``online`` chose where reads beside what each delivered.

    python -m bench.online_replay --base-model ../shared/models/bench-code \
        --draft-model ../shared/models/bench-code-eagle3 --data ../shared/data/longctx_eval.jsonl \
        --length 4096 --prompts 4 --tree-config 32:0.0:10 --out bench/results/online_replay.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.forced_acceptance import (
    LOOKAHEAD,
    WHOLE,
    TargetText,
    accepted_path,
    add_text_arguments,
    cached_text,
    working_set_arg,
)
from bench.reproduce.output import device_name
from bench.reproduce.prompts import load_datasets, prompts_at
from diffspec.settings import DiffSpecSettings, parse_sizes
from diffspec.tree import DraftTree
from draft_service.backend import DraftAccept, DraftBatch, DraftStart, VerifyCost
from draft_service.hazard import StepCostModel
from draft_service.options import DraftOptions
from draft_service.runtime import DraftRuntime
from draft_service.tree_budget import TreeBudget
from gateway.assembly import build_draft, build_target, load_tokenizer

H100_64K_VERIFY_MS = "16=7.24,32=10.55,64=13.23"  # bound audits and the protocol's 16-token arm, 2026-12-06
H100_64K_DRAFT_MS = "6=1.14,8=1.50,10=1.87"  # int8 head over the working set, batch 1
H100_64K_OVERHEAD_MS = 0.29
ARMS = ("full", "online")


class FrozenCost(StepCostModel):
    """A step cost model that measured a GPU once and learns nothing more: the runtime's observations of the
    machine it runs on (a CPU) are dropped."""

    def observe_verify(self, rows: int, seconds: float) -> None:
        pass

    def observe_draft(self, depths: int, seconds: float, batch: int = 1, attended_tokens: int = 0) -> None:
        pass

    def observe_step(self, step_seconds: float, proposal_seconds: float, verify_seconds: float) -> None:
        pass


def frozen_cost(
    verify_ms: dict[int, float], draft_ms: dict[int, float], overhead_ms: float, graph_tree_sizes: tuple[int, ...] = ()
) -> FrozenCost:
    """The frozen model of ``verify_ms`` (tree tokens -> ms, batch 1), ``draft_ms`` (depths -> ms) and a step's
    overhead; a verify computes its tree padded to the step graph bucket of ``graph_tree_sizes``, as on the GPU."""
    cost = FrozenCost(graph_batch_sizes=(1,), graph_tree_sizes=graph_tree_sizes)
    for tokens, ms in verify_ms.items():
        StepCostModel.observe_verify(cost, tokens, ms / 1000)
    cost.draft_seconds_by_shape = {(1, 0): {depth: ms / 1000 for depth, ms in draft_ms.items()}}  # nearest to all
    cost.draft_measured = True
    cost.step_overhead_seconds, cost.overhead_measured = overhead_ms / 1000, True
    return cost


def milliseconds_arg(text: str) -> dict[int, float]:
    """``N=MS,N=MS,...`` (tree tokens or depths to milliseconds), or argparse's error."""
    try:
        points = {int(n): float(ms) for n, ms in (item.split("=") for item in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected N=MS pairs, comma-separated") from None
    if len(points) < 2 or any(n <= 0 or ms <= 0 for n, ms in points.items()):
        raise argparse.ArgumentTypeError(f"{text!r}: at least two points, each positive")
    return points


@dataclass(frozen=True)
class ReplayedStep:
    """One step of a run: the tree proposed and what the text accepted of it."""

    tree: str  # the label of the candidate it was grown as: ``full T:P:D``, a shaped tree's widths, a probe's
    nodes: int  # tree nodes, the root included
    depth: int  # draft depths the proposal ran
    emitted: int  # accepted drafts and the bonus token


STEP_FIELDS = [field.name for field in dataclasses.fields(ReplayedStep)]  # the columns of a run's ``per_step``


@dataclass(frozen=True)
class ReplayedRun:
    """One arm along one prompt's text."""

    prompt: int
    arm: str  # full or online
    steps: int
    tokens: int  # emitted: accepted drafts and the bonus token per step
    seconds: float  # the frozen model's price of its steps
    per_step: tuple[ReplayedStep, ...]  # in order: which trees ``online`` chose where, and what each delivered

    def totals(self) -> dict:
        """Every figure of the run but its steps, with its tau and tokens per second."""
        run = {key: value for key, value in vars(self).items() if key != "per_step"}
        return {**run, **rates(self.steps, self.tokens, self.seconds)}

    def to_dict(self) -> dict:
        return {**self.totals(), "per_step": [list(vars(step).values()) for step in self.per_step]}


def rates(steps: int, tokens: int, seconds: float) -> dict[str, float]:
    """tau and the frozen model's tokens per second, as the JSON reports them, for one run or an arm's sum."""
    return {"tau": round(tokens / steps, 3), "tokens_per_s": round(tokens / seconds, 1)}


def replay(
    runtime: DraftRuntime, text: TargetText, new_tokens: int, options: DraftOptions, prompt: int
) -> ReplayedRun:
    """One request of ``options`` along ``text`` until ``new_tokens`` are out (the first, the prefill's, counted as
    the engine counts it), each step priced by the runtime's frozen cost model."""
    cost, length, cont = runtime.step_cost, len(text.prompt_ids), text.continuation
    session_id = f"{options.policy}-{prompt}"
    start = DraftStart(session_id, text.prompt_ids, text.features[:length], cont[0], options)
    trees = runtime.step(DraftBatch(starts=[start], proposes=[session_id])).trees
    steps: list[ReplayedStep] = []
    root, seconds = 0, 0.0  # root: the continuation index of the current tree's root
    while root < new_tokens - 1:
        tree = DraftTree.of(trees[session_id])
        rows = cost.computed_rows(1, tree.num_nodes)  # the step graph bucket the verify runs in
        verify_seconds = cost.verify_seconds(rows, length + root)
        depth = runtime.last_proposal_depth
        seconds += cost.step_overhead_seconds + cost.draft_seconds(depth) + verify_seconds
        emitted = len(accepted_path(tree, cont[root + 1 :])) + 1
        grown_as = runtime.sessions[session_id].last_candidate
        assert grown_as is not None  # the step that returned this tree proposed it
        steps.append(ReplayedStep(grown_as.label, tree.num_nodes, depth, emitted))
        features = text.features[length + root : length + root + emitted]  # the root's and the accepted entries'
        accept = DraftAccept(session_id, cont[root + 1 : root + 1 + emitted], features)
        root += emitted
        proposes = [session_id] if root < new_tokens - 1 else []
        verify = VerifyCost(rows=rows, seconds=verify_seconds)
        trees = runtime.step(DraftBatch(accepts=[accept], proposes=proposes, verify_cost=verify)).trees
    runtime.step(DraftBatch(releases=[session_id]))
    return ReplayedRun(prompt, options.policy, len(steps), root, seconds, tuple(steps))


def summarise(runs: list[ReplayedRun]) -> dict[str, dict]:
    """Per arm over its prompts: tau and the frozen model's tokens per second."""
    summary = {}
    for arm in dict.fromkeys(r.arm for r in runs):
        mine = [r for r in runs if r.arm == arm]
        steps, tokens, seconds = (sum(getattr(r, f) for r in mine) for f in ("steps", "tokens", "seconds"))
        summary[arm] = {"prompts": len(mine), **rates(steps, tokens, seconds)}
    return summary


def plot(runs: list[ReplayedRun], path: Path, title: str) -> None:
    """Predicted tokens per second per prompt, a bar per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prompts = list(dict.fromkeys(r.prompt for r in runs))
    arms = list(dict.fromkeys(r.arm for r in runs))
    fig, ax = plt.subplots(figsize=(1.2 * len(prompts) + 3, 4))
    for k, arm in enumerate(arms):
        speed = {r.prompt: r.tokens / r.seconds for r in runs if r.arm == arm}
        ax.bar([i + k / (len(arms) + 1) for i in range(len(prompts))], [speed[p] for p in prompts],
               width=1 / (len(arms) + 1), label=arm)  # fmt: skip
    ax.set_xticks([i + 0.5 / (len(arms) + 1) * (len(arms) - 1) for i in range(len(prompts))], [str(p) for p in prompts])
    ax.set_xlabel("prompt")
    ax.set_ylabel("tokens/s (frozen cost model)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_text_arguments(parser)
    parser.add_argument("--length", type=int, default=4096, help="prompt tokens (each prompt cut to its last ones)")
    parser.add_argument("--first-prompt", type=int, default=0, help="the dataset index the prompts are taken from on")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128,
                        help="the first token included, as the engine counts")
    parser.add_argument("--tree-config", type=TreeBudget.parse, default=TreeBudget.parse("32:0.0:10"),
                        help="both arms' budget: full's tree, online's own (start) budget")
    parser.add_argument("--working-set", type=working_set_arg, default="2048:0",
                        help="'whole' or BUDGET:RECENT tokens (RECENT 0: the settings' default)")
    parser.add_argument("--verify-ms", type=milliseconds_arg, default=milliseconds_arg(H100_64K_VERIFY_MS),
                        help="a verify's milliseconds by tree tokens, TOKENS=MS,...")
    parser.add_argument("--draft-ms", type=milliseconds_arg, default=milliseconds_arg(H100_64K_DRAFT_MS),
                        help="a proposal's milliseconds by depth, DEPTH=MS,...")
    parser.add_argument("--overhead-ms", type=float, default=H100_64K_OVERHEAD_MS, help="a step's time besides both")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.tree_config.depth >= LOOKAHEAD:
        parser.error(f"--tree-config: a depth under {LOOKAHEAD}, the tokens decoded past the last one counted")

    update = {"base_model": args.base_model, "draft_model": args.draft_model,
              "num_pages": (args.length + args.max_new_tokens) // 16 + 64}  # fmt: skip
    if args.working_set != WHOLE:
        budget, recent = (int(part) for part in args.working_set.split(":"))
        update.update(working_set_tokens=budget, salience_recent_tokens=recent)
    settings = DiffSpecSettings(**update)
    tokenizer = load_tokenizer(settings)
    dataset = load_datasets([args.data], lambda text: tokenizer(text)["input_ids"])[0]
    target = build_target(settings)
    runtime = build_draft(settings, target)
    if not isinstance(runtime, DraftRuntime):
        parser.error(f"no draft head at {args.draft_model}")
    graph_tree_sizes = parse_sizes(settings.graph_tree_sizes)
    runtime.step_cost = frozen_cost(args.verify_ms, args.draft_ms, args.overhead_ms, graph_tree_sizes)
    runs: list[ReplayedRun] = []
    for index, ids in prompts_at(dataset, args.length, args.first_prompt, args.prompts):
        key = f"{dataset.name}_{args.length}_{index}_{args.max_new_tokens}"
        text = cached_text(target, ids, args.max_new_tokens, args.cache, key)
        for arm in ARMS:
            options = DraftOptions(arm, args.tree_config.config, salience=args.working_set != WHOLE)
            runs.append(replay(runtime, text, args.max_new_tokens, options, index))
            print(f"prompt {index} {arm}: {json.dumps(runs[-1].totals())}", flush=True)
    summary = summarise(runs)
    result = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "device": device_name(),
              "cost_model": {"verify_ms": args.verify_ms, "draft_ms": args.draft_ms, "overhead_ms": args.overhead_ms},
              "summary": summary, "per_step_fields": STEP_FIELDS, "runs": [r.to_dict() for r in runs]}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(runs, args.out.with_suffix(".png"), f"{args.tree_config.config}, {args.working_set}, {args.length} tokens")
    for arm, row in summary.items():
        print(f"{arm}: tau {row['tau']:.2f}, {row['tokens_per_s']:.1f} tokens/s by the frozen model", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
