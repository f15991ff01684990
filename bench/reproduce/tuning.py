"""The tuning pass: every DiffSpec candidate on the tuning prompts; the fastest one wins."""

from __future__ import annotations

from dataclasses import dataclass, replace

from bench.reproduce.arms import Arm
from bench.reproduce.runs import RunRecord


@dataclass(frozen=True)
class CandidateScore:
    dataset: str
    context: int
    label: str  # e.g. diffspec[online 64:0.0:8]
    policy: str
    tree_config: str
    prompts: int
    tau: float  # accepted drafts + 1 bonus per verification step
    decode_tokens_per_s: float  # tokens after the first over decode seconds, summed over prompts
    chosen: bool = False


def decode_tokens_per_second(runs: list[RunRecord]) -> float:
    """Tokens after each run's first over the runs' decode seconds (the decode-only figure)."""
    seconds = sum(r.stats.decode_seconds for r in runs)
    return sum(r.stats.new_tokens - 1 for r in runs) / seconds if seconds > 0 else 0.0


def tau(runs: list[RunRecord]) -> float:
    steps = sum(r.stats.steps for r in runs)
    return sum(r.stats.accepted_drafts + r.stats.steps for r in runs) / steps if steps else 0.0


def score_candidates(candidates: list[Arm], runs: list[RunRecord]) -> list[CandidateScore]:
    """One score per candidate over its runs of one (dataset, context); the fastest decode is chosen
    (the first listed wins a tie)."""
    scores = []
    for arm in candidates:
        assert arm.draft is not None, "candidates draft"
        mine = [r for r in runs if r.label == arm.label]
        scores.append(CandidateScore(
            mine[0].dataset, mine[0].context, arm.label, arm.draft.policy, arm.draft.tree_config, len(mine),
            round(tau(mine), 4), round(decode_tokens_per_second(mine), 3),
        ))
    best = max(range(len(scores)), key=lambda i: scores[i].decode_tokens_per_s)
    return [replace(score, chosen=i == best) for i, score in enumerate(scores)]
