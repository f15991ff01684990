"""One generation judged against Auto's by the near-tie rule (``exactness.py``), on the evidence that
``replay.py`` gathers. The reproduce protocol judges every evaluated run with it, and the bf16 GPU tests
(``tests/bench/test_gpu_bf16_exactness.py``) the engine's generations.

Order of the evidence, cheapest first where it decides. Greedy: the fp32 Auto run of the prompt (made once
per prompt; its logprobs at the divergence are the fp32 top tokens whenever it generated the shared tokens
too), the serving runtime's spread there, and only for a divergence that rounding could explain the arm's
own fp32 run, the costliest (at 64K on an 8B target, a minute-long fp32 prefill per arm). Sampled: the fp32
boundaries (from the ``transformers`` replay: an fp32 run's logprobs hold too few tokens for a cumulative
mass) and their serving spread, then only where the uniform lies within that spread of both boundaries the
arm's fp32 run with the seed (against fp32 Auto's with the seed).

The GPU holds one source's models at a time: at 64K on an 8B target the fp32 engine with its KV (52 GB), the
fp32 reference with its cache (49 GB) and the serving runtime (25 GB) do not fit beside one another and a
prefill's activations. A switch costs a reload (seconds) against runs of a minute.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

from bench.reproduce.exactness import (
    Divergence,
    ExactnessResult,
    SampledTieEvidence,
    TieEvidence,
    classify,
    classify_sampled,
    first_divergence,
    rounding_gap,
)
from bench.reproduce.fp32_rerun import Fp32Rerun
from bench.reproduce.replay import TargetReplay
from diffspec.acceptance import TokenUniforms
from diffspec.sampling_params import SamplingParams
from draft_service.options import DraftOptions


class Judge:
    """The rule's evidence sources for one serving configuration; each loads its model at first use."""

    def __init__(self, replay: TargetReplay, rerun: Fp32Rerun) -> None:
        self.replay = replay
        self.rerun = rerun
        # (prompts run together, options, tokens) -> per prompt, whether the arm's fp32 run diverges
        self._fp32_diverges: dict[tuple[tuple[tuple[int, ...], ...], DraftOptions, int], list[bool]] = {}

    @property
    def sampling(self) -> SamplingParams:
        """The judged runs' sampling (every arm's, seed included): the rule's fp32 runs repeat it."""
        return self.rerun.sampling

    def verdict(
        self, prompt: list[int], auto: list[int], arm: list[int], draft: DraftOptions | None, verify_tokens: int,
        max_new_tokens: int, ran_with: list[list[int]] | None = None,
    ) -> ExactnessResult:  # fmt: skip
        """``arm``'s tokens for ``prompt`` against ``auto``'s. ``draft``: the arm's options; None for a
        generator outside the engine (no fp32 run of it can be made, so any divergence is a mismatch).
        ``verify_tokens``: its largest verify (the tree budget's total). ``ran_with``: the prompts the arm ran
        at once, this one among them; their fp32 runs then run at once too (None: this prompt alone)."""
        divergence = first_divergence(auto, arm)
        if divergence is None:
            return ExactnessResult("exact", "same tokens as Auto")
        shared, following = auto[: divergence.position], auto[divergence.position :]
        if self.sampling.greedy:
            evidence = self._greedy_evidence(prompt, shared, following, verify_tokens, max_new_tokens)
            gap = rounding_gap(divergence, evidence)
            explained = gap is not None and gap < evidence.spread
            judged = partial(classify, divergence, evidence)
        else:
            sampled = self._sampled_evidence(prompt + shared, following, verify_tokens, divergence)
            explained = sampled is not None and sampled.within_spread()
            judged = partial(classify_sampled, divergence, sampled)
        if not explained or draft is None:
            return judged()  # a mismatch whatever the fp32 run: it is not made
        return judged(self._arm_diverges_in_fp32(prompt, draft, max_new_tokens, ran_with))

    def close(self) -> None:
        self.rerun.close()
        self.replay.release()

    def _greedy_evidence(
        self, prompt: list[int], shared: list[int], following: list[int], verify_tokens: int, max_new_tokens: int
    ) -> TieEvidence:
        """The fp32 top tokens from the fp32 Auto run where it has them, then the serving spread."""
        self.replay.release()
        fp32_top = self.rerun.auto_run(prompt, max_new_tokens).top_after(shared)
        self.rerun.close()
        return self.replay.evidence(prompt + shared, following, verify_tokens, fp32_top)

    def _sampled_evidence(
        self, prefix: list[int], following: list[int], verify_tokens: int, divergence: Divergence
    ) -> SampledTieEvidence | None:
        """The replay's boundaries and spread at the uniform the seed gives the divergence's index; None where a
        generation ended (there are no two tokens to decide between)."""
        if divergence.ended:
            return None
        assert self.sampling.seed is not None, "an unseeded run's uniforms are not known"
        self.rerun.close()
        uniform = float(TokenUniforms(self.sampling.generator()).window(divergence.position + 1)[-1])
        return self.replay.sampled_evidence(prefix, following, verify_tokens, divergence, uniform, self.sampling)

    def _arm_diverges_in_fp32(
        self, prompt: list[int], draft: DraftOptions, max_new_tokens: int, ran_with: list[list[int]] | None
    ) -> bool:
        group = ran_with or [prompt]
        key = (tuple(tuple(ids) for ids in group), draft, max_new_tokens)
        if key not in self._fp32_diverges:
            concurrent = ran_with is not None
            self.replay.release()
            self._fp32_diverges[key] = self.rerun.diverges(group, draft, max_new_tokens, concurrent=concurrent)
        return self._fp32_diverges[key][group.index(prompt)]


def pending(divergence: Divergence) -> ExactnessResult:
    """A divergence the judging has not reached: what a report written before the replays says of it."""
    return ExactnessResult("unchecked", f"not judged yet: the report was written before the judging; diverges from "
                           f"Auto at token {divergence.position}", divergence)


class JudgingLimit:
    """The judging's time limit (``--judge-minutes``): past it, a divergence not yet judged is left unchecked
    rather than judged (its fp32 runs take a minute and more at 64K on an 8B target), so a run that must end
    by a machine's deadline still writes its report."""

    def __init__(self, minutes: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.deadline = None if minutes is None else clock() + 60 * minutes
        self.left_unchecked = 0

    def reached(self) -> bool:
        return self.deadline is not None and self.clock() >= self.deadline

    def unchecked(self, divergence: Divergence) -> ExactnessResult:
        self.left_unchecked += 1
        return ExactnessResult("unchecked", f"not judged: the judging's time limit came first (--judge-minutes); "
                               f"diverges from Auto at token {divergence.position}", divergence)
