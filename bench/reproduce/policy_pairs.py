"""``online`` against ``full`` at the same start tree, prompt by prompt: is the gap between them more than noise?

Why. The tuning pass runs both policies at every tree and working-set setting on the same prompts, so each
(phase, context, tree, working set, prompt) that both ran is a pair whose ratio of decode speeds cancels the
prompt's own difficulty. The rule that ``online`` be at least as fast as ``full`` is read on these pairs: per
context, the geometric mean of the ratios and a seeded bootstrap interval over the pairs (``INTERVAL``). A
context whose interval holds 1 is one where this run cannot tell the two apart; on the 8B-shaped pair a ratio's
spread over pairs is about 8%, so 32 pairs place a mean within about 3% either way.

    python -m bench.reproduce.policy_pairs bench/results/reproduce_..._results.json.gz   # an earlier run's pairs
    python -m bench.reproduce.policy_pairs RUN_A.json.gz RUN_B.json.gz                   # two runs' pairs, pooled
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.reproduce.checkpoint import load_run_document
from bench.reproduce.runs import RunRecord
from bench.reproduce.tuning import CandidateScore, decode_tokens_per_second
from gateway.request import GenerationStats

PAIRED_PHASES = ("tune", "final")  # the tuning pass's rounds: the evaluation runs DiffSpec once, tuned
INTERVAL = 0.95  # the bootstrap interval's coverage
RESAMPLES = 4000


@dataclass(frozen=True)
class PolicyPairs:
    """``online`` / ``full`` decode speed over one (dataset, context)'s pairs."""

    dataset: str
    context: int
    pairs: int
    ratio: float  # geometric mean of online / full decode tokens/s
    low: float  # the bootstrap interval's ends (``INTERVAL``) for that mean
    high: float

    @property
    def verdict(self) -> str:
        if self.low > 1:
            return "online ahead"
        return "online behind" if self.high < 1 else "not told apart"


def policy_pairs(runs: list[RunRecord], scores: list[CandidateScore], seed: int = 0) -> list[PolicyPairs]:
    """Every (dataset, context) where ``online`` and ``full`` ran at the same tree, working set and prompt."""
    return summarized(log_ratios(runs, scores), seed)


def log_ratios(runs: list[RunRecord], scores: list[CandidateScore]) -> dict[tuple[str, int], list[float]]:
    """Per (dataset, context), log(online / full decode tokens/s) of each pair of one run's tuning rounds."""
    candidates = {(s.dataset, s.context, s.label): s for s in scores}
    speeds: dict[tuple, dict[str, float]] = {}
    for run in runs:
        score = candidates.get((run.dataset, run.context, run.label))
        if run.phase not in PAIRED_PHASES or score is None or score.policy not in ("online", "full"):
            continue
        key = (run.dataset, run.context, run.phase, score.tree_config, score.salience, run.prompt)
        speeds.setdefault(key, {})[score.policy] = decode_tokens_per_second([run])
    logs: dict[tuple[str, int], list[float]] = {}
    for (dataset, context, *_), pair in speeds.items():
        if pair.get("online", 0) > 0 and pair.get("full", 0) > 0:
            logs.setdefault((dataset, context), []).append(math.log(pair["online"] / pair["full"]))
    return logs


def summarized(logs: dict[tuple[str, int], list[float]], seed: int = 0) -> list[PolicyPairs]:
    """Each (dataset, context)'s geometric mean ratio and its seeded bootstrap interval."""
    rng = random.Random(seed)
    return [PolicyPairs(dataset, context, len(values), math.exp(statistics.fmean(values)),
                        *_bootstrap_interval(values, rng))
            for (dataset, context), values in logs.items()]  # fmt: skip


def _bootstrap_interval(values: list[float], rng: random.Random) -> tuple[float, float]:
    """The ``INTERVAL`` interval of the geometric mean, from ``RESAMPLES`` resamples of the log ratios."""
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(RESAMPLES))
    tail = (1 - INTERVAL) / 2
    return math.exp(means[int(tail * RESAMPLES)]), math.exp(means[int((1 - tail) * RESAMPLES) - 1])


def recorded_pairs(*documents: dict) -> list[PolicyPairs]:
    """The pairs of runs' ``results.json`` documents, pooled per (dataset, context): their tuning scores and, of
    each run, what pairing reads. Pairs of different runs stay apart (a prompt of one run pairs only there)."""
    pooled: dict[tuple[str, int], list[float]] = {}
    for document in documents:
        runs = [RunRecord(r["phase"], r["dataset"], r["context"], r["prompt"], r["arm"], r["label"], [],
                          GenerationStats(new_tokens=r["stats"]["new_tokens"],
                                          decode_seconds=r["stats"]["decode_seconds"]),
                          r["request_seconds"], r["first_token_seconds"], None)
                for r in document["runs"]]  # fmt: skip
        scores = [CandidateScore(**score) for score in document.get("tuning", [])]
        for key, values in log_ratios(runs, scores).items():
            pooled.setdefault(key, []).extend(values)
    return summarized(pooled)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Earlier reproduce runs' online/full pairs, per context, pooled.")
    parser.add_argument("results", type=Path, nargs="+", help="each run's results.json (or .json.gz), or its folder")
    args = parser.parse_args(argv)
    for pairs in recorded_pairs(*(load_run_document(path) for path in args.results)):
        print(f"{pairs.dataset} {pairs.context}: {pairs.pairs} pairs, online / full {pairs.ratio:.3f} "
              f"({INTERVAL:.0%} interval {pairs.low:.3f}-{pairs.high:.3f}): {pairs.verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
