"""The tuning pass: every DiffSpec candidate on the tuning prompts; the fastest one wins, and the winners
become a tuned profile (``tuned_profile.json``) that ``diffspec serve`` loads as its defaults
(``DIFFSPEC_TUNING_PROFILE``, ``draft_service/tuned_profile.py``)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from bench.reproduce.arms import Arm
from bench.reproduce.runs import RunRecord
from draft_service.tuned_profile import PROFILE_FORMAT

PROFILE_NAME = "tuned_profile.json"


@dataclass(frozen=True)
class CandidateScore:
    dataset: str
    context: int
    label: str  # e.g. diffspec[online 64:0.0:8]
    policy: str
    tree_config: str
    salience: bool
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
            mine[0].dataset, mine[0].context, arm.label, arm.draft.policy, arm.draft.tree_config, arm.draft.salience,
            len(mine),
            round(tau(mine), 4), round(decode_tokens_per_second(mine), 3),
        ))
    best = max(range(len(scores)), key=lambda i: scores[i].decode_tokens_per_s)
    return [replace(score, chosen=i == best) for i, score in enumerate(scores)]


def _options(score: CandidateScore) -> dict:
    return {"policy": score.policy, "tree_config": score.tree_config, "salience": score.salience}


def tuned_profile(scores: list[CandidateScore], provenance: dict) -> dict:
    """The profile document: per dataset and context the chosen candidate, and ``default`` per context the
    candidate with the best geometric mean over datasets of its decode speed relative to each dataset's
    fastest (with one dataset, the chosen one; the first listed wins a tie)."""
    datasets: dict[str, list[dict]] = {}
    for score in (s for s in scores if s.chosen):
        datasets.setdefault(score.dataset, []).append({
            "context": score.context, **_options(score),
            "tau": score.tau, "decode_tokens_per_s": score.decode_tokens_per_s,
        })
    default = []
    for context in sorted({s.context for s in scores}):
        mine = [s for s in scores if s.context == context]
        fastest = {d: max(s.decode_tokens_per_s for s in mine if s.dataset == d) for d in {s.dataset for s in mine}}
        relative: dict[tuple, list[float]] = {}
        for s in mine:
            ratio = s.decode_tokens_per_s / fastest[s.dataset] if fastest[s.dataset] > 0 else 1.0
            relative.setdefault(tuple(_options(s).values()), []).append(math.log(max(ratio, 1e-9)))
        best = max(relative, key=lambda options: sum(relative[options]) / len(relative[options]))
        default.append({"context": context, **dict(zip(("policy", "tree_config", "salience"), best))})
    return {"format": PROFILE_FORMAT, **provenance, "datasets": datasets, "default": default}


def write_tuned_profile(out_dir: Path, scores: list[CandidateScore], provenance: dict) -> Path | None:
    """``tuned_profile.json`` in ``out_dir`` (nothing when no case was tuned)."""
    if not scores:
        return None
    path = out_dir / PROFILE_NAME
    path.write_text(json.dumps(tuned_profile(scores, provenance), indent=1))
    return path
