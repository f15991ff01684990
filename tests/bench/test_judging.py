"""bench/reproduce/judging.py: which evidence a verdict asks for, in which order, and how often; with stand-ins
for the replays (their own tests are in test_exactness_rule.py)."""

from __future__ import annotations

import torch

from bench.reproduce.exactness import Divergence, SampledTieEvidence, TieEvidence
from bench.reproduce.fp32_rerun import GREEDY, Fp32AutoRun
from bench.reproduce.judging import Judge
from diffspec.acceptance import TokenUniforms
from diffspec.sampling_params import SamplingParams, TokenLogprobs
from draft_service.options import DraftOptions

AUTO = [5, 6, 7, 8]
TIED = [5, 6, 9, 8]  # parts at position 2, where fp32 ranks 7 then 9 close together
FAR = [5, 6, 4, 8]  # parts at position 2 with a token fp32 does not rank near the top
OPTIONS = DraftOptions("full", "16:0.0:4")
SAMPLED = SamplingParams(temperature=0.8, seed=3)
CDF_SPREAD = 0.01


def auto_run(tokens: list[int]) -> Fp32AutoRun:
    top_ids = [[t, 9] for t in tokens]
    return Fp32AutoRun(tokens, TokenLogprobs([0.0] * len(tokens), top_ids, [[-0.70, -0.72]] * len(tokens)))


class GpuLedger:
    """Which stand-in holds models on the GPU, and whether two ever ran while both held them."""

    def __init__(self) -> None:
        self.holding: set[str] = set()
        self.overlaps: list[str] = []

    def use(self, source: str, what: str) -> None:
        self.holding.add(source)
        if len(self.holding) > 1:
            self.overlaps.append(what)


class StubRerun:
    def __init__(self, auto_tokens: list[int], gpu: GpuLedger, sampling: SamplingParams) -> None:
        self.auto_tokens = auto_tokens
        self.gpu = gpu
        self.sampling = sampling
        self.auto_runs: list[tuple[int, ...]] = []
        self.arm_runs: list[tuple[int, bool]] = []  # (prompts, concurrent)

    def auto_run(self, prompt: list[int], max_new_tokens: int) -> Fp32AutoRun:
        self.gpu.use("rerun", "fp32 Auto run")
        self.auto_runs.append(tuple(prompt))
        return auto_run(self.auto_tokens)

    def diverges(
        self, prompts: list[list[int]], draft: DraftOptions, max_new_tokens: int, concurrent: bool
    ) -> list[bool]:
        self.gpu.use("rerun", "fp32 arm run")
        self.arm_runs.append((len(prompts), concurrent))
        return [False] * len(prompts)

    def close(self) -> None:
        self.gpu.holding.discard("rerun")


class StubReplay:
    def __init__(self, gpu: GpuLedger, boundary_distance: float) -> None:
        self.gpu = gpu
        self.fp32_tops: list[object] = []
        self.boundary_distance = boundary_distance  # how far both fp32 boundaries lie from the uniform
        self.uniforms: list[float] = []  # per sampled evidence asked for

    def release(self) -> None:
        self.gpu.holding.discard("replay")

    def evidence(self, prefix, following, verify_tokens, fp32_top=None) -> TieEvidence:  # noqa: ANN001
        self.gpu.use("replay", "evidence")
        self.fp32_tops.append(fp32_top)
        values, ids = fp32_top if fp32_top is not None else (torch.tensor([1.0, 0.99]), torch.tensor([7, 9]))
        gaps = {int(i): float(values[0] - v) for i, v in zip(ids, values)}
        return TieEvidence(int(ids[0]), int(ids[1]), float(values[0] - values[1]), spread=0.05, fp32_gaps=gaps)

    def sampled_evidence(
        self, prefix, following, verify_tokens, divergence: Divergence, uniform: float, params: SamplingParams
    ) -> SampledTieEvidence:
        self.gpu.use("replay", "sampled evidence")
        self.uniforms.append(uniform)
        distance = self.boundary_distance
        return SampledTieEvidence(uniform, uniform + distance, uniform - distance, CDF_SPREAD)


def judge(
    auto_tokens: list[int] = AUTO, sampling: SamplingParams = GREEDY, boundary_distance: float = 0.0
) -> tuple[Judge, StubReplay, StubRerun]:
    gpu = GpuLedger()
    replay, rerun = StubReplay(gpu, boundary_distance), StubRerun(auto_tokens, gpu, sampling)
    return Judge(replay, rerun), replay, rerun  # type: ignore[arg-type]


def test_an_equal_generation_needs_no_evidence():
    j, replay, rerun = judge()
    assert j.verdict([1, 2], AUTO, AUTO, OPTIONS, 16, 4).verdict == "exact"
    assert (replay.fp32_tops, rerun.auto_runs, rerun.arm_runs) == ([], [], [])


def test_a_tie_takes_its_fp32_evidence_from_the_fp32_auto_run_and_runs_the_arm_once_per_group():
    j, replay, rerun = judge()
    prompts = [[1, 2], [3, 4]]
    verdicts = [j.verdict(p, AUTO, TIED, OPTIONS, 16, 4, ran_with=prompts) for p in prompts]
    assert [v.verdict for v in verdicts] == ["near-tie", "near-tie"]
    assert abs(verdicts[0].evidence.fp32_gaps[9] - 0.02) < 1e-6  # the run's logprob gap, as a logit gap
    assert all(top is not None for top in replay.fp32_tops)  # no transformers replay was asked for
    assert rerun.arm_runs == [(2, True)]  # both prompts' arm runs at once, as the arm ran, and only once


def test_a_divergence_rounding_cannot_explain_is_a_mismatch_without_the_arms_fp32_run():
    j, _, rerun = judge()
    assert j.verdict([1, 2], AUTO, FAR, OPTIONS, 16, 4).verdict == "mismatch"
    assert rerun.arm_runs == []


def test_a_generator_outside_the_engine_has_no_fp32_run_so_its_divergence_is_a_mismatch():
    j, _, rerun = judge()
    result = j.verdict([1, 2], AUTO, TIED, None, 64, 4)
    assert result.verdict == "mismatch" and "not checked" in result.reason and rerun.arm_runs == []


def test_where_the_fp32_auto_run_took_another_way_the_replay_computes_the_fp32_top():
    j, replay, _ = judge(auto_tokens=[5, 3, 7, 8])  # fp32 Auto parted from the bf16 tokens before position 2
    assert j.verdict([1, 2], AUTO, TIED, OPTIONS, 16, 4).verdict == "near-tie"
    assert replay.fp32_tops == [None]


def test_the_gpu_holds_one_evidence_sources_models_at_a_time():
    j, replay, rerun = judge(auto_tokens=[5, 3, 7, 8])  # the replay's own fp32 top is needed too
    prompts = [[1, 2], [3, 4]]
    for prompt in prompts:
        assert j.verdict(prompt, AUTO, TIED, OPTIONS, 16, 4).verdict == "near-tie"
    assert len(rerun.auto_runs) == 2 and len(rerun.arm_runs) == 2 and len(replay.fp32_tops) == 2
    assert replay.gpu.overlaps == []
    j.close()
    assert replay.gpu.holding == set()


def test_a_sampled_divergence_within_the_spread_runs_the_arms_fp32_run_once_per_group_and_is_a_near_tie():
    j, replay, rerun = judge(sampling=SAMPLED, boundary_distance=CDF_SPREAD / 2)
    prompts = [[1, 2], [3, 4]]
    verdicts = [j.verdict(p, AUTO, TIED, OPTIONS, 16, 4, ran_with=prompts) for p in prompts]
    assert [v.verdict for v in verdicts] == ["near-tie", "near-tie"]
    seeded = float(TokenUniforms(SAMPLED.generator()).window(3)[2])  # the seed's uniform of index 2, where they part
    assert replay.uniforms == [seeded, seeded] and verdicts[0].sampled_evidence.uniform == seeded
    assert replay.fp32_tops == [] and rerun.auto_runs == []  # no greedy evidence: top tokens make no cumulative mass
    assert rerun.arm_runs == [(2, True)]


def test_a_sampled_divergence_outside_the_spread_is_a_mismatch_without_the_arms_fp32_run():
    j, replay, rerun = judge(sampling=SAMPLED, boundary_distance=CDF_SPREAD)
    result = j.verdict([1, 2], AUTO, TIED, OPTIONS, 16, 4)
    assert result.verdict == "mismatch" and "not both below" in result.reason
    assert len(replay.uniforms) == 1 and rerun.arm_runs == []


def test_a_sampled_generation_that_ended_is_a_mismatch_without_evidence():
    j, replay, rerun = judge(sampling=SAMPLED, boundary_distance=CDF_SPREAD / 2)
    result = j.verdict([1, 2], AUTO, AUTO[:2], OPTIONS, 16, 4)
    assert result.verdict == "mismatch" and "ended" in result.reason
    assert (replay.uniforms, rerun.arm_runs) == ([], [])


def test_sampled_judging_holds_one_evidence_sources_models_at_a_time():
    j, replay, rerun = judge(sampling=SAMPLED, boundary_distance=CDF_SPREAD / 2)
    for prompt in ([1, 2], [3, 4]):
        assert j.verdict(prompt, AUTO, TIED, OPTIONS, 16, 4).verdict == "near-tie"
    assert len(replay.uniforms) == 2 and len(rerun.arm_runs) == 2
    assert replay.gpu.overlaps == []
    j.close()
    assert replay.gpu.holding == set()
