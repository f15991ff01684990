"""How the hazard estimates move over a generation and across prompts, from a reproduce run.

The draft keeps one ``HazardProfile`` per request (decay ``REQUEST_DECAY``), smoothed toward a global
profile (decay ``GLOBAL_DECAY``) that every request's steps feed. A reproduce run records each
drafting step (``bench/reproduce/draft_steps.py``: accepted drafts, the tree's depth, the sibling
rank that passed at each depth, the width where the path stopped), the warm-ups' steps included, so
replaying them in run order through the same class gives the estimate after every step exactly.

Figures, per (dataset, context, drafting arm), over the evaluated prompts:
- **top-1 hazard** h1(d) = P(the draft's best child at depth d is rejected), the estimate every
  width is built from, after each step of a generation;
- **drift**: mean |h1_t(d) - h1_{t-1}(d)| per step (how much one step moves it), and **settle**:
  mean |h1_t(d) - h1_final(d)| over the generation's second half (how far it still is from where it ends);
- **across prompts**: mean and standard deviation of the final h1(d) over the prompts;
- **pooled**: the hazard the trees met, (steps that stopped at d) / (steps that tested depth d),
  a path that ran off a leaf being censored there;
- **check**: for fixed-shape policies, the largest difference between the replayed final estimate
  at the policy's widths and the hazard the engine reported for the request (rounded to 1e-4).

    python -m bench.hazard_stability_analysis results/full_<stamp>/results.json --out-dir bench/results/hazard_stability

writes ``hazard_stability.md``, ``hazard_stability.json``, ``hazard_over_generation.png`` and
``hazard_across_prompts.png``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.reproduce.checkpoint import load_run_document, run_folder
from bench.reproduce.draft_steps import DraftStep
from draft_service.hazard import HazardProfile
from draft_service.options import DraftOptions, validate_options
from draft_service.runtime import GLOBAL_DECAY, REQUEST_DECAY
from draft_service.tree_budget import MAX_DEPTH
from draft_service.tree_plan import fixed_candidate

LABEL = re.compile(r"\[(?P<policy>\S+) (?P<config>\S+)\]$")  # e.g. diffspec[online 64:0.0:8]


@dataclass(frozen=True)
class RunTrajectory:
    """One drafting run's replayed estimates."""

    phase: str
    dataset: str
    context: int
    prompt: int
    arm: str
    label: str
    steps: list[DraftStep]  # as recorded
    top1: list[list[float]]  # [steps][depths] h1(d) after each step, d = 1..depths
    reported: list[float]  # the engine's final h(d) for the request (at its last widths)
    check: float | None  # max |replayed - reported| at a fixed policy's widths; None for online


@dataclass(frozen=True)
class StabilityRow:
    """One (dataset, context, arm) over its evaluated prompts."""

    dataset: str
    context: int
    arm: str
    label: str
    prompts: int
    steps: int
    final_mean: list[float]  # [depths] mean over prompts of the final h1(d)
    final_std: list[float]  # [depths] standard deviation over prompts (0 with one prompt)
    drift: float  # mean |h1_t - h1_{t-1}| per step, over depths and prompts
    settle: float  # mean |h1_t - h1_final| over each generation's second half
    pooled: list[float | None]  # [depths] stops / tests, pooled over the prompts
    check: float | None  # worst replay-vs-engine difference (fixed-shape policies)


def fixed_widths(label: str) -> list[int] | None:
    """Children per depth of a fixed-shape policy's plan (the widths its reported hazard is at)."""
    match = LABEL.search(label)
    if match is None or match["policy"] == "online":
        return None
    policy, budget = validate_options(DraftOptions(match["policy"], match["config"]))
    return fixed_candidate(policy, budget).widths


def pooled_hazard(steps: list[DraftStep], depths: int) -> list[float | None]:
    """(steps that stopped at d) / (steps that tested d) for d = 1..depths; a leaf censors its step."""
    stopped, tested = [0] * depths, [0] * depths
    for step in steps:
        for d in range(min(step.accepted, depths)):  # passed depths 1..accepted
            tested[d] += 1
        if step.stop_width > 0 and step.accepted < depths:  # the children at depth accepted + 1 all failed
            tested[step.accepted] += 1
            stopped[step.accepted] += 1
    return [s / t if t else None for s, t in zip(stopped, tested)]


def replay(document: dict, depths: int) -> list[RunTrajectory]:
    """Every drafting run's estimates, replayed in run order with the warm-ups in place."""
    global_profile = HazardProfile(MAX_DEPTH, GLOBAL_DECAY)
    warmups = {w["before_run"]: w["steps"] for w in document.get("warmup_draft_steps", [])}
    trajectories = []
    for index, run in enumerate(document["runs"]):
        for row in warmups.get(index, []):
            step = DraftStep.from_list(row)
            global_profile.observe(step.passed_ranks, step.stop_width)
        if not run.get("draft_steps"):  # Auto, the reference, or a run recorded before draft steps were
            continue
        profile = HazardProfile(MAX_DEPTH, REQUEST_DECAY, prior=global_profile)
        steps = [DraftStep.from_list(row) for row in run["draft_steps"]]
        top1 = []
        for step in steps:
            profile.observe(step.passed_ranks, step.stop_width)
            top1.append(profile.hazard([1] * depths))
        reported = run["stats"]["hazard"]
        widths = fixed_widths(run["label"])
        check = None
        if widths is not None and reported:
            check = max(abs(a - b) for a, b in zip(profile.hazard(widths), reported))
        trajectories.append(RunTrajectory(run["phase"], run["dataset"], run["context"], run["prompt"], run["arm"],
                                          run["label"], steps, top1, reported, check))
    return trajectories


def _mean_abs(pairs: list[tuple[list[float], list[float]]]) -> float:
    diffs = [abs(a - b) for x, y in pairs for a, b in zip(x, y)]
    return statistics.fmean(diffs) if diffs else 0.0


def stability(trajectories: list[RunTrajectory], depths: int) -> list[StabilityRow]:
    """One row per (dataset, context, arm) of the evaluated runs, in run order."""
    evaluated = [t for t in trajectories if t.phase == "eval"]
    rows = []
    for key in dict.fromkeys((t.dataset, t.context, t.arm) for t in evaluated):
        mine = [t for t in evaluated if (t.dataset, t.context, t.arm) == key]
        finals = [t.top1[-1] for t in mine]
        checks = [t.check for t in mine if t.check is not None]
        rows.append(StabilityRow(
            dataset=key[0], context=key[1], arm=key[2], label=mine[0].label, prompts=len(mine),
            steps=sum(len(t.top1) for t in mine),
            final_mean=[round(statistics.fmean(col), 4) for col in zip(*finals)],
            final_std=[round(statistics.pstdev(col), 4) for col in zip(*finals)],
            drift=round(_mean_abs([(a, b) for t in mine for a, b in zip(t.top1[1:], t.top1)]), 4),
            settle=round(_mean_abs([(h, t.top1[-1]) for t in mine for h in t.top1[len(t.top1) // 2:]]), 4),
            pooled=[None if h is None else round(h, 4) for h in pooled_hazard([s for t in mine for s in t.steps], depths)],
            check=round(max(checks), 6) if checks else None,
        ))
    return rows


def _cells(values: list[float | None]) -> str:
    return " / ".join("-" if v is None else f"{v:.2f}" for v in values)


def markdown(rows: list[StabilityRow], source: str, depths: int) -> str:
    lines = [
        "# Hazard stability", "",
        f"From `{source}`. h1(d): the replayed top-1 hazard estimate (P(the best child at depth d is rejected)), "
        f"d = 1..{depths}. Drift: mean |change| per step; settle: mean |h1 - final h1| over the second half of a "
        "generation; pooled: stops / tests at d over the trees actually proposed; check: largest replay-vs-engine "
        "difference of the final hazard (fixed-shape policies).", "",
        "| dataset | context | arm | prompts | steps | final h1 (mean) | final h1 (std over prompts) | drift | settle "
        "| pooled h | check |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines += [f"| {r.dataset} | {r.context} | {r.label} | {r.prompts} | {r.steps} | {_cells(r.final_mean)} "
              f"| {_cells(r.final_std)} | {r.drift:.3f} | {r.settle:.3f} | {_cells(r.pooled)} "
              f"| {'-' if r.check is None else f'{r.check:.1e}'} |" for r in rows]
    return "\n".join(lines) + "\n"


def plot(trajectories: list[RunTrajectory], rows: list[StabilityRow], out_dir: Path, depths: int) -> list[Path]:
    """hazard_over_generation.png (one panel per arm and context, a line per prompt and depth) and
    hazard_across_prompts.png (final h1 by depth, mean and spread over prompts, one panel per arm)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evaluated = [t for t in trajectories if t.phase == "eval"]
    arms = list(dict.fromkeys(r.label.split("[")[0] for r in rows))
    contexts = sorted({r.context for r in rows})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(len(arms), len(contexts), figsize=(3.6 * len(contexts), 2.8 * len(arms)),
                             squeeze=False, sharey=True)
    for i, arm in enumerate(arms):
        for j, context in enumerate(contexts):
            ax = axes[i][j]
            for t in (t for t in evaluated if t.arm == arm and t.context == context):
                for d in range(min(depths, 3)):
                    ax.plot([h[d] for h in t.top1], color=colors[d % len(colors)], alpha=0.6,
                            label=f"d={d + 1}" if t.prompt == min(x.prompt for x in evaluated) else None)
            ax.set_title(f"{arm} @ {context}", fontsize=9)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        axes[i][0].set_ylabel("top-1 hazard")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    over = out_dir / "hazard_over_generation.png"
    fig.savefig(over, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(arms), figsize=(4.2 * len(arms), 3.4), squeeze=False, sharey=True)
    for ax, arm in zip(axes[0], arms):
        for r in (r for r in rows if r.label.split("[")[0] == arm):
            x = list(range(1, len(r.final_mean) + 1))
            ax.errorbar(x, r.final_mean, yerr=r.final_std, marker="o", capsize=3, label=f"{r.dataset} {r.context}")
        ax.set_title(arm)
        ax.set_xlabel("draft depth d")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("final top-1 hazard (mean, std over prompts)")
    fig.tight_layout()
    across = out_dir / "hazard_across_prompts.png"
    fig.savefig(across, dpi=110)
    plt.close(fig)
    return [over, across]


def analyse(results: Path, out_dir: Path, depths: int) -> list[StabilityRow]:
    """Read a reproduce run's results.json; write the table, the JSON and the two plots into ``out_dir``."""
    document = load_run_document(results)
    trajectories = replay(document, depths)
    rows = stability(trajectories, depths)
    if not rows:
        raise SystemExit(f"{results}: no evaluated drafting run recorded its draft steps")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "hazard_stability.md").write_text(markdown(rows, str(results), depths))
    (out_dir / "hazard_stability.json").write_text(json.dumps({
        "source": str(results),
        "command": document.get("command"),
        "depths": depths,
        "rows": [asdict(r) for r in rows],
        "runs": [{"phase": t.phase, "dataset": t.dataset, "context": t.context, "prompt": t.prompt, "label": t.label,
                  "top1": [[round(h, 4) for h in step] for step in t.top1], "reported": t.reported, "check": t.check}
                 for t in trajectories],
    }, indent=1))
    plot(trajectories, rows, out_dir, depths)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="results.json of a python -m bench.reproduce run, or its folder")
    parser.add_argument("--out-dir", type=Path, help="default: the results file's folder")
    parser.add_argument("--depths", type=int, default=4, help="draft depths shown (1..N)")
    args = parser.parse_args(argv)
    rows = analyse(args.results, args.out_dir or run_folder(args.results), args.depths)
    print(markdown(rows, str(args.results), args.depths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
