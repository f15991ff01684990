"""Exactness verdicts: every arm's greedy tokens against Auto's, with bf16 near-ties named.

Terms:
- **divergence**: the first generated position where an arm's token differs from Auto's (or where
  one of them ended and the other did not).
- **fp32 margin**: at that position, the target's top-1 minus top-2 logit when the shared prefix is
  replayed in fp32.
- **spread**: the largest difference of that position's logits between a 1-token decode and a
  T-token verify of the same prefix in the serving dtype; the rounding that different GEMM shapes
  alone can cause there.
- **near-tie**: a divergence that rounding explains: the fp32 replay picks Auto's token, the arm's
  token is the fp32 runner-up, and the fp32 margin is below the spread. Anything else is a
  **mismatch**: the engine changed a token that the target would not have.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

Verdict = Literal["exact", "near-tie", "mismatch", "unchecked"]
ENDED = -1  # token id standing for "this generation had already ended"


@dataclass(frozen=True)
class Divergence:
    position: int  # index into the generated tokens; both agree on [0, position)
    auto_token: int  # ENDED when Auto had stopped there
    arm_token: int  # ENDED when the arm had stopped there


@dataclass(frozen=True)
class TieEvidence:
    """What the fp32 and serving-dtype replays say about one position."""

    fp32_top1: int
    fp32_top2: int
    fp32_margin: float  # top-1 minus top-2 logit, fp32
    spread: float  # max |decode - verify| logit at this position, serving dtype


@dataclass(frozen=True)
class ExactnessResult:
    verdict: Verdict
    reason: str
    divergence: Divergence | None = None
    evidence: TieEvidence | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def first_divergence(auto_tokens: list[int], arm_tokens: list[int]) -> Divergence | None:
    """Where two greedy generations first part, or None when they are equal."""
    for position, (auto, arm) in enumerate(zip(auto_tokens, arm_tokens)):
        if auto != arm:
            return Divergence(position, auto, arm)
    if len(auto_tokens) == len(arm_tokens):
        return None
    position = min(len(auto_tokens), len(arm_tokens))
    auto = auto_tokens[position] if position < len(auto_tokens) else ENDED
    arm = arm_tokens[position] if position < len(arm_tokens) else ENDED
    return Divergence(position, auto, arm)


def classify(divergence: Divergence, evidence: TieEvidence) -> ExactnessResult:
    """Near-tie or mismatch, from the replays at the divergence."""
    if ENDED in (divergence.auto_token, divergence.arm_token):
        return ExactnessResult("mismatch", "one generation ended where the other went on", divergence, evidence)
    if evidence.fp32_top1 != divergence.auto_token:
        return ExactnessResult("mismatch", "the fp32 target does not pick Auto's token", divergence, evidence)
    if evidence.fp32_top2 != divergence.arm_token:
        return ExactnessResult("mismatch", "the arm's token is not the fp32 runner-up", divergence, evidence)
    if not evidence.fp32_margin < evidence.spread:
        return ExactnessResult(
            "mismatch",
            f"fp32 margin {evidence.fp32_margin:.3g} is not below the decode/verify spread {evidence.spread:.3g}",
            divergence, evidence,
        )
    return ExactnessResult(
        "near-tie",
        f"fp32 margin {evidence.fp32_margin:.3g} below the decode/verify spread {evidence.spread:.3g}",
        divergence, evidence,
    )
