"""The tuning pass: every DiffSpec candidate on the tuning prompts; the fastest one wins, and the winners
become a tuned profile (``tuned_profile.json``) that ``diffspec serve`` loads as its defaults
(``DIFFSPEC_TUNING_PROFILE``, ``draft_service/tuned_profile.py``).

With a final round (``tune_finalists``), the first pass only shortlists: its few dozen verification steps
per candidate rank close candidates by noise. The finalists run again on the same prompts with the
evaluation's tokens, and the fastest there wins, unless others come within ``FINAL_TIE`` of it: a final round
of two prompts cannot order those (on the 8B-shaped pair at 16K, two finalists 1.5% apart in the final round
decoded the evaluation prompts 13% apart, in the other order). Among those tied, the one that verifies the fewest
tree tokens per emitted token wins: at the same speed it leaves the most of the GPU to other streams. (The draft's
milliseconds a step do not say so: with the proposal queued behind the verify they are the host's wait in
whichever call first needs the GPU, and one configuration's two arms drafted 2.02 and 2.45 ms a step at equal
steps in one run.)

Stalls. Now and then one run's decode stalls for a quarter of a second (on an H100: a 4K final-round run at 24 ms
a step where its other prompts took 9.3, at no kernel compile), which in a round of four prompts moves its
candidate's speed by a fifth and can decide the choice. A run whose seconds per step exceed ``STALL_FACTOR``
times the median of its candidate's other runs in the round (``stalled_runs``) is run again, once; the stalled
run stays in the record under its own phase (``stalled_phase``)."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from bench.reproduce.arms import Arm
from bench.reproduce.runs import RunRecord
from draft_service.tuned_profile import PROFILE_FORMAT

PROFILE_NAME = "tuned_profile.json"
FINAL_TIE = 0.03  # finalists whose final decode speed is within this fraction of the fastest's are tied
STALL_FACTOR = 1.5  # a run this much slower a step than its candidate's median elsewhere in the round stalled


@dataclass(frozen=True)
class CandidateScore:
    """One candidate at one (dataset, context): its first pass's figures, and a finalist's final round's."""

    dataset: str
    context: int
    label: str  # e.g. diffspec[online 64:0.0:8]
    policy: str
    tree_config: str
    salience: bool
    prompts: int  # tuning prompts, the same in both rounds
    tau: float  # first pass: accepted drafts + 1 bonus per verification step
    decode_tokens_per_s: float  # first pass: tokens after the first over decode seconds, summed over prompts
    final_tau: float | None = None  # final round (finalists only)
    final_decode_tokens_per_s: float | None = None  # final round (finalists only): it chooses among them
    final_tree_tokens_per_token: float | None = None  # final round (finalists only): breaks a tie (``FINAL_TIE``)
    chosen: bool = False  # evaluated as the tuned arm


def decode_tokens_per_second(runs: list[RunRecord]) -> float:
    """Tokens after each run's first over the runs' decode seconds (the decode-only figure)."""
    seconds = sum(r.stats.decode_seconds for r in runs)
    return sum(r.stats.new_tokens - 1 for r in runs) / seconds if seconds > 0 else 0.0


def tau(runs: list[RunRecord]) -> float:
    steps = sum(r.stats.steps for r in runs)
    return sum(r.stats.accepted_drafts + r.stats.steps for r in runs) / steps if steps else 0.0


def score_candidates(candidates: list[Arm], runs: list[RunRecord]) -> list[CandidateScore]:
    """One score per candidate over its first-pass runs of one (dataset, context); the fastest decode is
    chosen (the first listed wins a tie)."""
    scores = []
    for arm in candidates:
        assert arm.draft is not None, "candidates draft"
        mine = [r for r in runs if r.label == arm.label]
        scores.append(CandidateScore(
            mine[0].dataset, mine[0].context, arm.label, arm.draft.policy, arm.draft.tree_config, arm.draft.salience,
            len(mine),
            round(tau(mine), 4), round(decode_tokens_per_second(mine), 3),
        ))
    return _choose(scores, [score.decode_tokens_per_s for score in scores])


def finalists(candidates: list[Arm], scores: list[CandidateScore], k: int) -> list[Arm]:
    """The ``k`` candidates of the fastest first pass (the first listed wins a tie), in the grid's order."""
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i].decode_tokens_per_s)[:k]
    return [arm for i, arm in enumerate(candidates) if i in ranked]


def score_finalists(scores: list[CandidateScore], runs: list[RunRecord]) -> list[CandidateScore]:
    """``scores`` with each finalist's figures over its final-round ``runs`` (every finalist on the same
    prompts), and a finalist chosen: of those within ``FINAL_TIE`` of the fastest, the one that verifies the
    fewest tree tokens per emitted token (the first listed wins a tie of that too)."""
    final = []
    for score in scores:
        mine = [r for r in runs if r.label == score.label]
        final.append(replace(
            score, final_tau=round(tau(mine), 4), final_decode_tokens_per_s=round(decode_tokens_per_second(mine), 3),
            final_tree_tokens_per_token=round(tree_tokens_per_token(mine), 3),
        ) if mine else score)  # fmt: skip
    fastest = max(s.final_decode_tokens_per_s or 0.0 for s in final)
    tied = [s.final_decode_tokens_per_s is not None and s.final_decode_tokens_per_s >= (1 - FINAL_TIE) * fastest
            for s in final]  # fmt: skip
    return _choose(final, [-s.final_tree_tokens_per_token if tie else -math.inf for s, tie in zip(final, tied)])


def stalled_runs(runs: list[RunRecord]) -> list[RunRecord]:
    """The runs of one round whose decode seconds per step exceed ``STALL_FACTOR`` times the median of the same
    candidate's other runs (a candidate's seconds a step vary little from prompt to prompt: a tenth at most)."""
    stalled = []
    for run in runs:
        others = [seconds_per_step(r) for r in runs if r.label == run.label and r is not run]
        if others and seconds_per_step(run) > STALL_FACTOR * statistics.median(others):
            stalled.append(run)
    return stalled


def seconds_per_step(run: RunRecord) -> float:
    return run.stats.decode_seconds / run.stats.steps if run.stats.steps else 0.0


def stalled_phase(phase: str) -> str:
    """The phase a stalled run is kept under, beside the run that replaced it: a phase no score reads."""
    return f"{phase}-stalled"


def tree_tokens_per_token(runs: list[RunRecord]) -> float:
    """Tree tokens the target verified (every proposed node, the root included) per token it emitted (the
    accepted drafts and the bonus), over the runs' recorded steps."""
    steps = [step for r in runs for step in r.draft_steps]
    emitted = sum(step.accepted + 1 for step in steps)
    return sum(step.tree_tokens for step in steps) / emitted if emitted else 0.0


def draft_ms_per_step(runs: list[RunRecord]) -> float:
    steps = sum(r.stats.steps for r in runs)
    return 1000 * sum(r.stats.draft_seconds for r in runs) / steps if steps else 0.0


def _choose(scores: list[CandidateScore], merit: list[float]) -> list[CandidateScore]:
    """``scores`` with the one of the highest ``merit`` chosen, and only it (the first listed wins a tie)."""
    best = max(range(len(scores)), key=lambda i: merit[i])
    return [replace(score, chosen=i == best) for i, score in enumerate(scores)]


def _options(score: CandidateScore) -> dict:
    return {"policy": score.policy, "tree_config": score.tree_config, "salience": score.salience}


def _relative_speed(score: CandidateScore, case: list[CandidateScore]) -> float:
    """``score``'s decode speed over the fastest of its (dataset, context) ``case`` in the round that ranked it
    there: the final round for a finalist, the first pass for the rest."""
    if score.final_decode_tokens_per_s is None:
        mine, fastest = score.decode_tokens_per_s, max(s.decode_tokens_per_s for s in case)
    else:
        mine, fastest = score.final_decode_tokens_per_s, max(s.final_decode_tokens_per_s or 0.0 for s in case)
    return mine / fastest if fastest > 0 else 1.0


def tuned_profile(scores: list[CandidateScore], provenance: dict) -> dict:
    """The profile document: per dataset and context the chosen candidate, and ``default`` per context the
    candidate with the best geometric mean over datasets of its decode speed relative to each dataset's
    fastest, finalists by their final round (with one dataset, the chosen one; the first listed wins a tie)."""
    datasets: dict[str, list[dict]] = {}
    for score in (s for s in scores if s.chosen):
        datasets.setdefault(score.dataset, []).append({
            "context": score.context, **_options(score),
            "tau": score.tau, "decode_tokens_per_s": score.decode_tokens_per_s,
        })
    default = []
    for context in sorted({s.context for s in scores}):
        mine = [s for s in scores if s.context == context]
        relative: dict[tuple, list[float]] = {}
        for s in mine:
            ratio = _relative_speed(s, [c for c in mine if c.dataset == s.dataset])
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
