"""The trees a policy picked at each context, from a reproduce run.

A reproduce run records every drafting step (``bench/reproduce/draft_steps.py``) with its tree's
depth and tokens. For the runs of one policy (default ``online``, the DiffSpec candidates and the
tuned arm; tuning and evaluation runs alike), per (dataset, context):
- the **tree tokens** of each step, as a histogram: the size the policy verified;
- the **shapes** (depth, tokens) it proposed, as a count map: a dynamic tree of the candidate grid
  shows as its budget (e.g. 8 deep, 64 tokens), a hazard-shaped one as its own size;
- a row per case: steps, mean tokens and depth, tau (accepted drafts + 1 per step), its commonest shapes.

    python -m bench.policy_trees results/full_<stamp>/results.json --out-dir bench/results/policy_trees

The run's folder works too, before its ``results.json`` exists (its ``runs.jsonl``).

writes ``policy_trees.png``, ``policy_trees.json`` and ``policy_trees.md``.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.reproduce.checkpoint import load_run_document, run_folder
from bench.reproduce.draft_steps import DraftStep

COMMON_SHAPES = 4  # shapes listed per case


@dataclass(frozen=True)
class TreeUse:
    """What one policy proposed over one (dataset, context)."""

    dataset: str
    context: int
    runs: int
    steps: int
    mean_tokens: float  # tree tokens per step, root included
    mean_depth: float
    tau: float  # accepted drafts + 1 bonus per step
    shapes: list[tuple[int, int, int]]  # (depth, tokens, steps), every shape proposed, commonest first


def tree_uses(document: dict, policy: str) -> list[TreeUse]:
    """One row per (dataset, context) where runs labelled with ``policy`` recorded draft steps."""
    steps_of: dict[tuple[str, int], list[DraftStep]] = collections.defaultdict(list)
    runs_of: collections.Counter[tuple[str, int]] = collections.Counter()
    for run in document["runs"]:
        if f"[{policy} " in run["label"] and run.get("draft_steps"):
            key = (run["dataset"], run["context"])
            steps_of[key] += [DraftStep.from_list(row) for row in run["draft_steps"]]
            runs_of[key] += 1
    rows = []
    for (dataset, context), steps in sorted(steps_of.items()):
        shapes = collections.Counter((s.tree_depth, s.tree_tokens) for s in steps)
        rows.append(TreeUse(
            dataset, context, runs_of[dataset, context], len(steps),
            round(sum(s.tree_tokens for s in steps) / len(steps), 2),
            round(sum(s.tree_depth for s in steps) / len(steps), 2),
            round(sum(s.accepted + 1 for s in steps) / len(steps), 3),
            [(depth, tokens, count) for (depth, tokens), count in shapes.most_common()],
        ))
    return rows


def markdown(rows: list[TreeUse], source: str, policy: str) -> str:
    lines = [f"# Trees `{policy}` picked", "", f"From `{source}`.", "",
             "| dataset | context | runs | steps | mean tokens | mean depth | tau "
             "| commonest shapes (depth x tokens: share) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        common = ", ".join(f"{d}x{t}: {n / r.steps:.0%}" for d, t, n in r.shapes[:COMMON_SHAPES])
        lines.append(f"| {r.dataset} | {r.context} | {r.runs} | {r.steps} | {r.mean_tokens:.1f} | {r.mean_depth:.1f} "
                     f"| {r.tau:.2f} | {common} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[TreeUse], path: Path, policy: str) -> Path:
    """Per case a column: the tree tokens histogram above, the (tokens, depth) count map below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(rows), figsize=(4.2 * len(rows), 6.4), squeeze=False)
    largest = max(t for r in rows for _, t, _ in r.shapes)
    for (top, bottom), r in zip(axes.T, rows):
        tokens = [t for _, t, n in r.shapes for _ in range(n)]
        top.hist(tokens, bins=range(0, largest + 9, 8), color="tab:blue", edgecolor="white")
        top.set_title(f"{r.dataset} @ {r.context} ({r.steps} steps, tau {r.tau:.2f})", fontsize=9)
        top.set_xlabel("tree tokens per step")
        top.set_ylabel("steps")
        depths, sizes, counts = zip(*r.shapes)
        bottom.scatter(sizes, depths, s=[40 + 400 * n / r.steps for n in counts], alpha=0.6, color="tab:orange")
        for depth, size, count in r.shapes[:COMMON_SHAPES]:
            bottom.annotate(f"{count / r.steps:.0%}", (size, depth), fontsize=7, ha="center", va="center")
        bottom.set_xlabel("tree tokens")
        bottom.set_ylabel("tree depth")
        bottom.set_xlim(0, largest + 8)
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    fig.suptitle(f"trees the {policy} policy picked, by context")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def analyse(results: Path, out_dir: Path, policy: str = "online") -> list[TreeUse]:
    """Read a reproduce run's results.json (or its folder); write the table, the JSON and the plot into ``out_dir``."""
    document = load_run_document(results)
    rows = tree_uses(document, policy)
    if not rows:
        raise SystemExit(f"{results}: no {policy} run recorded its draft steps")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "policy_trees.md").write_text(markdown(rows, str(results), policy))
    written = {"source": str(results), "command": document.get("command"), "policy": policy,
               "rows": [asdict(r) for r in rows]}  # fmt: skip
    (out_dir / "policy_trees.json").write_text(json.dumps(written, indent=1))
    plot(rows, out_dir / "policy_trees.png", policy)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="results.json of a python -m bench.reproduce run, or its folder")
    parser.add_argument("--out-dir", type=Path, help="default: the run's folder")
    parser.add_argument("--policy", default="online", help="the policy whose runs are drawn (as in the arm labels)")
    args = parser.parse_args(argv)
    rows = analyse(args.results, args.out_dir or run_folder(args.results), args.policy)
    print(markdown(rows, str(args.results), args.policy))
    return 0


if __name__ == "__main__":
    sys.exit(main())
