"""Figures of a reproduce run: per dataset, tau and decode-only / end-to-end speedups by context."""

from __future__ import annotations

from pathlib import Path

from bench.reproduce.report import ArmSummary

PANELS = (
    ("tau", "tau (accepted + bonus per step)"),
    ("decode_speedup", "decode-only speedup vs Auto"),
    ("end_to_end_speedup", "end-to-end speedup vs Auto"),
    ("draft_ms_per_step", "draft ms per step"),
)


def context_points(summaries: list[ArmSummary], key: str) -> list[tuple[int, float]]:
    """(context, the summary's ``key``) of each summary that has it, by context: a run's contexts come in the
    order asked for, and the line joins its points in the order given."""
    return sorted((s.context, getattr(s, key)) for s in summaries if getattr(s, key) is not None)


def plot_summaries(summaries: list[ArmSummary], out_dir: Path, prefix: str = "") -> list[Path]:
    """One PNG per dataset, ``<prefix><dataset>.png``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for dataset in dict.fromkeys(s.dataset for s in summaries):
        fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4))
        for arm in dict.fromkeys(s.arm for s in summaries):
            mine = [s for s in summaries if s.dataset == dataset and s.arm == arm]
            for ax, (key, _) in zip(axes, PANELS):
                points = context_points(mine, key)
                ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=arm)
        for ax, (_, title) in zip(axes, PANELS):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context tokens")
            ax.set_title(title)
            ax.grid(alpha=0.3)
        axes[0].legend()
        fig.suptitle(dataset)
        fig.tight_layout()
        path = out_dir / f"{prefix}{dataset.replace('/', '_')}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
