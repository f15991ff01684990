"""Tau and decode tokens/s per tree policy and budget across contexts, from a reproduce run.

The tuning pass of ``python -m bench.reproduce`` runs every (policy, ``total:threshold:depth``, working set
or whole context) candidate on the tuning prompts of each dataset and context; this
lays those scores out as one row per candidate and one column per context, with the fraction of
that context's best decode speed and the winner marked. The evaluated arms (Auto, the EAGLE-3
baselines, DiffSpec tuned; evaluation prompts, not the tuning ones) follow in a second table.

    python -m bench.branch_policy_analysis results/full_<stamp>/results.json --out-dir bench/results/branch_policy

writes ``branch_policy.md``, ``branch_policy.json`` and ``branch_policy_<dataset>.png`` (tau and decode
tokens/s by context, a line per candidate, the chosen ones starred, Auto's evaluated speed dashed).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class PolicyCell:
    """One candidate at one context (tuning prompts)."""

    tau: float  # accepted drafts + 1 bonus per verification step
    decode_tokens_per_s: float
    of_best: float  # decode tokens/s over the fastest candidate's at this context
    chosen: bool


@dataclass(frozen=True)
class PolicyRow:
    dataset: str
    policy: str
    tree_config: str  # total:threshold:depth
    salience: bool  # drafts over the working set (False: over the whole context)
    cells: dict[int, PolicyCell]  # context -> its scores

    @property
    def candidate(self) -> str:
        return f"{self.policy} {self.tree_config}" + ("" if self.salience else ", whole context")


def policy_rows(document: dict) -> list[PolicyRow]:
    """One row per (dataset, policy, config, working set or not) of the tuning pass, in the order it ran."""
    scores = document["tuning"]
    best = {}
    for s in scores:
        key = (s["dataset"], s["context"])
        best[key] = max(best.get(key, 0.0), s["decode_tokens_per_s"])
    rows: dict[tuple[str, str, str, bool], PolicyRow] = {}
    for s in scores:
        key = (s["dataset"], s["policy"], s["tree_config"], s["salience"])
        row = rows.setdefault(key, PolicyRow(*key, {}))
        fastest = best[(s["dataset"], s["context"])]
        row.cells[s["context"]] = PolicyCell(s["tau"], s["decode_tokens_per_s"],
                                             round(s["decode_tokens_per_s"] / fastest, 4) if fastest > 0 else 0.0,
                                             s["chosen"])
    return list(rows.values())


def _contexts(rows: list[PolicyRow], dataset: str) -> list[int]:
    return sorted({c for r in rows if r.dataset == dataset for c in r.cells})


def markdown(rows: list[PolicyRow], summaries: list[dict], source: str) -> str:
    lines = [
        "# Branch policies and budgets across contexts", "",
        f"From `{source}`. Tuning pass: each cell is tau / decode tok/s (fraction of the context's fastest "
        "candidate); **bold** = chosen for the evaluation (by the final round, where the run had one: "
        "results.md).", "",
    ]
    for dataset in dict.fromkeys(r.dataset for r in rows):
        contexts = _contexts(rows, dataset)
        lines += [f"## {dataset}", "", "| candidate | " + " | ".join(str(c) for c in contexts) + " |",
                  "| --- | " + " | ".join("---" for _ in contexts) + " |"]
        for r in (r for r in rows if r.dataset == dataset):
            cells = []
            for c in contexts:
                cell = r.cells.get(c)
                text = "-" if cell is None else f"{cell.tau:.2f} / {cell.decode_tokens_per_s:.1f} ({cell.of_best:.2f})"
                cells.append(f"**{text}**" if cell is not None and cell.chosen else text)
            lines.append(f"| {r.candidate} | " + " | ".join(cells) + " |")
        lines.append("")
        evaluated = [s for s in summaries if s["dataset"] == dataset]
        if evaluated:
            lines += ["Evaluated arms (evaluation prompts): tau / decode tok/s (decode speedup over Auto).", "",
                      "| arm | " + " | ".join(str(c) for c in sorted({s["context"] for s in evaluated})) + " |",
                      "| --- | " + " | ".join("---" for _ in {s["context"] for s in evaluated}) + " |"]
            for arm in dict.fromkeys(s["arm"] for s in evaluated):
                by_context = {s["context"]: s for s in evaluated if s["arm"] == arm}
                cells = ["-" if c not in by_context else _arm_cell(by_context[c])
                         for c in sorted({s["context"] for s in evaluated})]
                lines.append(f"| {arm} | " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines)


def _arm_cell(summary: dict) -> str:
    """tau / decode tok/s (speedup), then what is in the label's brackets (the tree, or the reference's dtype)."""
    label = summary["label"]
    speedup = "-" if summary["decode_speedup"] is None else f"{summary['decode_speedup']:.2f}x"
    text = f"{summary['tau']:.2f} / {summary['decode_tokens_per_s']:.1f} ({speedup})"
    return text + (f" {label[label.index('[') + 1:-1]}" if "[" in label else "")


def plot(rows: list[PolicyRow], summaries: list[dict], out_dir: Path) -> list[Path]:
    """One PNG per dataset: tau and decode tokens/s against context, a line per candidate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for dataset in dict.fromkeys(r.dataset for r in rows):
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        for r in (r for r in rows if r.dataset == dataset):
            contexts = sorted(r.cells)
            for ax, key in ((left, "tau"), (right, "decode_tokens_per_s")):
                line, = ax.plot(contexts, [getattr(r.cells[c], key) for c in contexts], marker="o",
                                label=r.candidate)
                chosen = [c for c in contexts if r.cells[c].chosen]
                ax.plot(chosen, [getattr(r.cells[c], key) for c in chosen], marker="*", markersize=14,
                        linestyle="none", color=line.get_color())
        auto = sorted((s["context"], s["decode_tokens_per_s"]) for s in summaries
                      if s["dataset"] == dataset and s["arm"] == "auto")
        if auto:
            right.plot([c for c, _ in auto], [v for _, v in auto], linestyle="--", color="black", label="Auto (eval)")
        for ax, title in ((left, "tau (accepted + bonus per step)"), (right, "decode tokens/s")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context tokens")
            ax.set_title(title)
            ax.grid(alpha=0.3)
        right.legend(fontsize=7)
        fig.suptitle(f"{dataset}: tuning candidates (star = chosen)")
        fig.tight_layout()
        path = out_dir / f"branch_policy_{dataset.replace('/', '_')}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def analyse(results: Path, out_dir: Path) -> list[PolicyRow]:
    """Read a reproduce run's results.json; write the tables, the JSON and the plots into ``out_dir``."""
    document = json.loads(results.read_text())
    rows = policy_rows(document)
    if not rows:
        raise SystemExit(f"{results}: the run has no tuning pass")
    summaries = document.get("summaries", [])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "branch_policy.md").write_text(markdown(rows, summaries, str(results)))
    (out_dir / "branch_policy.json").write_text(json.dumps({
        "source": str(results), "command": document.get("command"),
        "rows": [{**asdict(r), "cells": {str(c): asdict(cell) for c, cell in r.cells.items()}} for r in rows],
    }, indent=1))
    plot(rows, summaries, out_dir)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="results.json of a python -m bench.reproduce run")
    parser.add_argument("--out-dir", type=Path, help="default: the results file's folder")
    args = parser.parse_args(argv)
    out_dir = args.out_dir or args.results.parent
    analyse(args.results, out_dir)
    print((out_dir / "branch_policy.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
