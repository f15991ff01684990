"""tau against the working set's recent window, from ``bench.forced_acceptance`` results.

The recent window is the part of the working set chosen by position rather than by score; sweeping it at a
fixed budget shows what the scored chunks add over the text just before the draft. One line per (context,
budget, tree); the whole context's tau at that context and tree as a dashed line.

    python -m bench.recent_window_plot bench/results/forced_acceptance_*_cpu.json --contexts 4096 65536 \
        --out bench/results/forced_acceptance_recent_window_cpu.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.forced_acceptance import WHOLE, budget_and_recent, summarise
from draft_service.working_set import WorkingSetConfig


def merged_runs(paths: list[Path]) -> tuple[list[dict], int]:
    """Every (context, working set, tree, prompt) row of the files, a later file's row replacing an earlier
    one's, and the chunk size they share (a recent window counts whole chunks)."""
    rows: dict[tuple, dict] = {}
    chunk_sizes = set()
    for path in paths:
        result = json.loads(path.read_text())
        chunk_sizes.add(result["settings"]["chunk_size"])
        for row in result["runs"]:
            rows[(row["context"], row["working_set"], row["tree_config"], row["prompt"])] = row
    if len(chunk_sizes) != 1:
        raise SystemExit(f"the files' chunk sizes differ: {sorted(chunk_sizes)}")
    return list(rows.values()), chunk_sizes.pop()


def window_lines(summaries: list[dict], chunk_size: int) -> dict[tuple[int, int, str], list[tuple[int, float]]]:
    """(context, budget tokens, tree) -> [(recent tokens the set holds, tau)] by window, for summaries over the
    same prompts; RECENT 0 (the default) counts as the window it gives."""
    lines: dict[tuple[int, int, str], list[tuple[int, float]]] = {}
    for summary in summaries:
        if summary["working_set"] == WHOLE:
            continue
        budget, recent = budget_and_recent(summary["working_set"])
        window = WorkingSetConfig.of_tokens(chunk_size, budget, recent).recent_chunks * chunk_size
        lines.setdefault((summary["context"], budget, summary["tree_config"]), []).append((window, summary["tau"]))
    return {key: sorted(points) for key, points in sorted(lines.items())}


def plot(summaries: list[dict], chunk_size: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    whole = {(s["context"], s["tree_config"]): s["tau"] for s in summaries if s["working_set"] == WHOLE}
    for (context, budget, tree), points in window_lines(summaries, chunk_size).items():
        line = ax.plot(*zip(*points), marker="o", label=f"{context // 1024}K, set of {budget}, full {tree}")[0]
        if (context, tree) in whole:
            ax.axhline(whole.pop((context, tree)), color=line.get_color(), linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("recent tokens in the working set (the rest chosen by score)")
    ax.set_ylabel("tau (accepted drafts + 1 per step)")
    ax.set_title("Acceptance against the working set's recent window (dashed: whole context)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path, help="bench.forced_acceptance JSON files")
    parser.add_argument("--out", type=Path, required=True, help="the PNG")
    parser.add_argument("--contexts", nargs="+", type=int, help="only these contexts (default: every one)")
    args = parser.parse_args()
    rows, chunk_size = merged_runs(args.results)
    rows = [row for row in rows if not args.contexts or row["context"] in args.contexts]
    plot(summarise(rows), chunk_size, args.out)


if __name__ == "__main__":
    main()
