"""The near-tie rule (bench/reproduce/exactness.py) and its evidence from the serving runtime and the fp32
run (bench/reproduce/replay.py), on the CPU with the bundled tiny pair."""

from __future__ import annotations

import math

import pytest
import torch

from bench.reproduce.exactness import (
    ENDED,
    Divergence,
    SampledTieEvidence,
    TieEvidence,
    classify,
    classify_sampled,
)
from bench.reproduce.fp32_rerun import Fp32Rerun
from bench.reproduce.replay import (
    ServingPath,
    TargetReplay,
    cdf_spread,
    cumulative_at,
    logit_spread,
    serving_paths,
)
from diffspec.sampling import inverse_cdf, target_probs
from diffspec.sampling_params import SamplingParams
from diffspec.settings import BUNDLED_TARGET, DiffSpecSettings
from diffspec.tree import DraftTree
from draft_service.options import DraftOptions
from gateway.assembly import load_tokenizer
from target_service.backend import VerifyStep
from target_service.llama import LlamaModel
from target_service.runtime import TargetRuntime

AUTO, ARM, THIRD = 10, 20, 30
AT = Divergence(position=3, auto_token=AUTO, arm_token=ARM)


@pytest.mark.parametrize(
    ("divergence", "evidence", "fp32_run_diverges", "verdict", "reason"),
    [
        # fp32 picks Auto's token, or the arm's: either side may be the one bf16 moved
        (AT, TieEvidence(AUTO, ARM, fp32_margin=0.01, spread=0.05), False, "near-tie", "the fp32 run does not diverge"),
        (AT, TieEvidence(ARM, AUTO, fp32_margin=0.01, spread=0.05), False, "near-tie", "the fp32 run does not diverge"),
        # the margin at, just above and far above the spread
        (AT, TieEvidence(AUTO, ARM, fp32_margin=0.05, spread=0.05), False, "mismatch", "is not below the serving spread"),
        (AT, TieEvidence(ARM, AUTO, fp32_margin=0.0625, spread=0.0625), False, "mismatch", "is not below"),
        (AT, TieEvidence(AUTO, ARM, fp32_margin=0.06, spread=0.05), False, "mismatch", "is not below"),
        (AT, TieEvidence(ARM, AUTO, fp32_margin=2.0, spread=0.05), False, "mismatch", "is not below"),
        (AT, TieEvidence(AUTO, ARM, fp32_margin=0.0, spread=0.0), False, "mismatch", "is not below"),
        # a third token among the fp32 top-2, the other one not among the top tokens at all
        (AT, TieEvidence(AUTO, THIRD, fp32_margin=0.01, spread=0.05), False, "mismatch", "are not both among the fp32 top"),
        (AT, TieEvidence(THIRD, ARM, fp32_margin=0.01, spread=0.05), False, "mismatch", "are not both among the fp32 top"),
        (AT, TieEvidence(THIRD, AUTO, fp32_margin=0.01, spread=0.05), False, "mismatch", "are not both among the fp32 top"),
        (AT, TieEvidence(AUTO, THIRD, 0.01, 0.05, {AUTO: 0.0, THIRD: 0.01, 40: 0.5, ARM: 2.0}), False, "mismatch",
         "gap 2 is not below"),  # listed, but far below the top
        # three tokens within the spread of the top: Auto's and the arm's may trade places
        (AT, TieEvidence(THIRD, AUTO, 0.01, 0.05, {THIRD: 0.0, AUTO: 0.01, ARM: 0.03}), False, "near-tie", "gap 0.03"),
        (AT, TieEvidence(AUTO, THIRD, 0.01, 0.05, {AUTO: 0.0, THIRD: 0.01, ARM: 0.05}), False, "mismatch", "is not below"),
        # the fp32 run diverges too, or was not run
        (AT, TieEvidence(AUTO, ARM, fp32_margin=0.01, spread=0.05), True, "mismatch", "the fp32 run diverges too"),
        (AT, TieEvidence(ARM, AUTO, fp32_margin=0.01, spread=0.05), None, "mismatch", "the fp32 run was not checked"),
        # an ended generation is never a tie
        (Divergence(3, AUTO, ENDED), TieEvidence(AUTO, ARM, 0.01, 0.05), False, "mismatch", "ended"),
        (Divergence(3, ENDED, ARM), TieEvidence(AUTO, ARM, 0.01, 0.05), False, "mismatch", "ended"),
    ],
)
def test_classify(divergence, evidence, fp32_run_diverges, verdict, reason):
    result = classify(divergence, evidence, fp32_run_diverges)
    assert result.verdict == verdict
    assert reason in result.reason
    assert (result.divergence, result.evidence, result.fp32_run_diverges) == (divergence, evidence, fp32_run_diverges)


U = 0.5  # the uniform at the divergence's index
NEAR = SampledTieEvidence(U, fp32_cdf_lo=0.505, fp32_cdf_below_hi=0.497, cdf_spread=0.01)


@pytest.mark.parametrize(
    ("divergence", "evidence", "fp32_run_diverges", "verdict", "reason"),
    [
        # u within the spread of both boundaries, whichever of Auto and the arm took the lower token id
        (AT, NEAR, False, "near-tie", "the fp32 run does not diverge"),
        (Divergence(3, ARM, AUTO), NEAR, False, "near-tie", "both below the serving cdf spread 0.01"),
        # outside one boundary's spread, or the other's, or at exactly the spread
        (AT, SampledTieEvidence(U, 0.52, 0.497, 0.01), False, "mismatch", "not both below"),
        (AT, SampledTieEvidence(U, 0.505, 0.48, 0.01), False, "mismatch", "lies 0.005 from fp32 F(lo) and 0.02 from"),
        (AT, SampledTieEvidence(U, U + 0.0625, U, 0.0625), False, "mismatch", "not both below"),
        (AT, SampledTieEvidence(U, U, U - 0.0625, 0.0625), False, "mismatch", "not both below"),
        (AT, SampledTieEvidence(U, U, U, 0.0), False, "mismatch", "not both below"),
        # the fp32 run diverges too, or was not run
        (AT, NEAR, True, "mismatch", "the fp32 run diverges too"),
        (AT, NEAR, None, "mismatch", "the fp32 run was not checked"),
        # an ended generation is never a tie, and has no boundaries to gather
        (Divergence(3, AUTO, ENDED), NEAR, False, "mismatch", "ended"),
        (Divergence(3, ENDED, ARM), None, False, "mismatch", "ended"),
    ],
)
def test_classify_sampled(divergence, evidence, fp32_run_diverges, verdict, reason):
    result = classify_sampled(divergence, evidence, fp32_run_diverges)
    assert result.verdict == verdict
    assert reason in result.reason
    assert (result.divergence, result.sampled_evidence, result.evidence) == (divergence, evidence, None)
    assert result.fp32_run_diverges == fp32_run_diverges


def test_cumulative_at_is_the_mass_through_each_token_id_that_inverse_cdf_draws_by():
    probs = torch.tensor([1.0, 2.0, 0.0, 1.0])  # unnormalised, as a filtered row may be
    cumulative = cumulative_at(probs, [0, 1, 2, 3])
    assert cumulative.dtype == torch.float64 and cumulative.tolist() == [0.25, 0.75, 0.75, 1.0]
    for uniform, token in [(0.0, 0), (0.2499, 0), (0.25, 1), (0.7499, 1), (0.75, 3), (0.9999, 3)]:
        assert int(inverse_cdf(probs[None], torch.tensor([uniform], dtype=torch.float64))) == token


def test_serving_paths_cover_decode_verify_batches_trees_and_depths():
    assert serving_paths(16, (1, 2, 4), (1, 8, 16, 32)) == [
        ServingPath(1, 1, 0),  # Auto's decode
        ServingPath(1, 16, 0), ServingPath(2, 16, 0), ServingPath(4, 16, 0),  # the verify, alone and in batches
        ServingPath(1, 8, 0),  # a smaller tree bucket
        ServingPath(1, 16, 1), ServingPath(1, 16, 7),  # the position deeper in a chain
    ]  # fmt: skip
    assert serving_paths(1, (1,), (1,)) == [ServingPath(1, 1, 0), ServingPath(1, 2, 0), ServingPath(1, 2, 1)]


VERIFY_TOKENS = 8
SMALL_BUCKETS = dict(graph_batch_sizes="1,2", graph_tree_sizes="1,4", num_pages=256)


FOLLOWING = [5, 6, 7]  # tokens after the replayed position: they fill the verified chains


@pytest.fixture(scope="module")
def replay_and_prompt() -> tuple[TargetReplay, list[int]]:
    settings = DiffSpecSettings(**SMALL_BUCKETS)
    prompt = load_tokenizer(settings)("import os\nimport sys\n\n\ndef main(argv):")["input_ids"]
    return TargetReplay(BUNDLED_TARGET, torch.float32, torch.device("cpu"), settings), prompt


@pytest.fixture(scope="module")
def unperturbed(replay_and_prompt) -> dict[ServingPath, torch.Tensor]:
    replay, prompt = replay_and_prompt
    return replay.serving_logits(prompt, FOLLOWING, VERIFY_TOKENS)


def test_serving_paths_agree_in_fp32_on_the_cpu(unperturbed):
    assert set(unperturbed) == set(serving_paths(VERIFY_TOKENS, (1, 2), (1, 4)))
    spread = logit_spread(unperturbed)
    assert math.isfinite(spread) and 0 <= spread < 1e-4  # float noise of different GEMM shapes, no more
    assert len({int(row.argmax()) for row in unperturbed.values()}) == 1


PERTURBED_TOKEN = 7
SAMPLED = SamplingParams(temperature=0.7, seed=0)


def perturb_forwards(monkeypatch: pytest.MonkeyPatch, rows: int, token: int, delta: float) -> None:
    """``token``'s logit of every serving forward over more than ``rows`` rows moved by ``delta``."""
    logits = LlamaModel.logits

    def perturbed(model: LlamaModel, hidden: torch.Tensor) -> torch.Tensor:
        out = logits(model, hidden)
        if hidden.shape[0] > rows:
            out[..., token] += delta
        return out

    monkeypatch.setattr(LlamaModel, "logits", perturbed)


def test_a_shift_of_every_logit_alike_spreads_nothing():
    """An argmax is decided by differences of logits: a path that shifts them all alike does not widen the
    spread, and two logits moving apart by 0.25 each widen it by 0.5."""
    base = torch.tensor([3.0, 2.9, -1.0, 0.5])
    shifted = {ServingPath(1, 1, 0): base, ServingPath(1, 8, 0): base + 0.25}
    assert logit_spread(shifted) == pytest.approx(0.0)
    apart = {ServingPath(1, 1, 0): base, ServingPath(1, 8, 0): base + torch.tensor([0.25, -0.25, 0.0, 0.0])}
    assert logit_spread(apart) == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("rows", "delta"),
    [
        (1, 0.25),  # every verify against Auto's 1-row decode
        (VERIFY_TOKENS, 0.5),  # only the verify batched with a filler session (8 + 1 rows)
    ],
)
def test_serving_spread_is_the_largest_difference_between_paths(replay_and_prompt, unperturbed, monkeypatch, rows, delta):
    """One token's logit of a forward over more than ``rows`` rows moved by ``delta``: its difference to every
    other logit changes by exactly that much on the paths that forward serves, and the spread says so."""
    replay, prompt = replay_and_prompt
    perturb_forwards(monkeypatch, rows, PERTURBED_TOKEN, delta)
    noise = logit_spread(unperturbed)
    assert replay.serving_spread(prompt, FOLLOWING, VERIFY_TOKENS) == pytest.approx(delta, abs=2 * noise + 1e-6)


def test_sampled_evidence_in_fp32_has_no_spread_and_the_fp32_logits_boundaries(replay_and_prompt):
    replay, prompt = replay_and_prompt
    logits = replay.fp32_logits(prompt)
    auto, arm = logits.topk(2).indices.tolist()
    evidence = replay.sampled_evidence(prompt, FOLLOWING, VERIFY_TOKENS, Divergence(0, auto, arm), U, SAMPLED)
    lo, hi = sorted((auto, arm))
    cumulative = torch.softmax(logits.double() / SAMPLED.temperature, dim=-1).cumsum(dim=-1)
    assert evidence.uniform == U
    assert evidence.fp32_cdf_lo == pytest.approx(float(cumulative[lo]), abs=1e-6)
    assert evidence.fp32_cdf_below_hi == pytest.approx(float(cumulative[hi - 1]), abs=1e-6)
    assert 0 <= evidence.cdf_spread < 1e-5  # float noise of different GEMM shapes, no more


@pytest.mark.parametrize(
    ("rows", "delta", "uniform"),
    [
        (1, 0.25, 0.3),  # every verify against Auto's 1-row decode
        (VERIFY_TOKENS, 0.5, 0.4),  # only the verify batched with a filler session (8 + 1 rows)
    ],  # each case a uniform of its own: the replay caches evidence per uniform
)
def test_the_cdf_spread_is_how_far_a_perturbed_path_moves_a_boundary(
    replay_and_prompt, unperturbed, monkeypatch, rows, delta, uniform
):
    """The fp32 top-1's logit of a forward over more than ``rows`` rows moved by ``delta``: the spread is how far
    that moves F(lo) or F(hi - 1) of Auto's decode, whichever moves further."""
    replay, prompt = replay_and_prompt
    decode = unperturbed[ServingPath(1, 1, 0)]
    auto, arm = decode.topk(2).indices.tolist()
    divergence = Divergence(0, auto, arm)
    moved = decode.clone()
    moved[auto] += delta
    boundaries = divergence.cdf_boundaries
    shift = cumulative_at(target_probs(moved, SAMPLED), boundaries) - cumulative_at(target_probs(decode, SAMPLED), boundaries)
    expected, noise = float(shift.abs().max()), cdf_spread(unperturbed, boundaries, SAMPLED)
    assert expected > 1000 * noise + 1e-6  # the perturbation, not float noise, is what the test measures
    perturb_forwards(monkeypatch, rows, auto, delta)
    evidence = replay.sampled_evidence(prompt, FOLLOWING, VERIFY_TOKENS, divergence, uniform, SAMPLED)
    assert evidence.cdf_spread == pytest.approx(expected, abs=2 * noise + 1e-9)


def test_fp32_run_of_the_same_prompts_does_not_diverge(replay_and_prompt):
    """The rule's second clause on the CPU, where the engine runs in fp32 anyway: Auto and a drafting arm,
    one prompt at a time and both prompts at once, generate the same tokens."""
    _, prompt = replay_and_prompt
    rerun = Fp32Rerun(DiffSpecSettings(num_pages=256))
    try:
        prompts = [prompt, prompt[:-3]]
        options = DraftOptions("full", "16:0.0:4")
        assert rerun.diverges(prompts, options, 6) == [False, False]
        assert rerun.diverges(prompts, options, 6, concurrent=True) == [False, False]
        assert rerun.auto_generations == 2  # one fp32 Auto run per prompt, shared by every later check of it
        assert rerun.diverges(prompts[:1], options, 5) == [False] and rerun.auto_generations == 3
    finally:
        rerun.close()


def test_verify_logits_match_the_step_and_commit_nothing(replay_and_prompt):
    """The runtime's replay hook: the logits a verify computes, with no token accepted or KV committed."""
    _, prompt = replay_and_prompt
    runtime = TargetRuntime(DiffSpecSettings(num_pages=64))
    first = runtime.prefill("s", prompt, SamplingParams(), want_features=False).first_token
    committed = runtime.committed_length("s")
    chain = DraftTree.chain([first, 5, 6])
    rows = runtime.verify_logits([VerifyStep("s", chain)])[0]
    forced = runtime.verify_logits([VerifyStep("s", DraftTree.root_only(7))])[0]  # any root, not only `first`
    assert rows.shape == (3, runtime.model.config.vocab_size) and forced.shape[0] == 1
    assert (runtime.committed_length("s"), runtime.pending_token("s")) == (committed, first)
    assert runtime.decode("s").bonus_token == int(rows[0].argmax())
    assert runtime.committed_length("s") == committed + 1


def test_arms_of_other_budgets_parting_at_one_position_share_the_fp32_prefill(replay_and_prompt, monkeypatch):
    replay, prompt = replay_and_prompt
    prefills = []
    fp32_forward = TargetReplay._fp32_forward

    def counted(self: TargetReplay, prefix_ids: list[int]) -> torch.Tensor:
        prefills.append(len(prefix_ids))
        return fp32_forward(self, prefix_ids)

    monkeypatch.setattr(TargetReplay, "_fp32_forward", counted)
    prefix = prompt + [11]  # a prefix no other test replays
    wide, narrow = replay.evidence(prefix, FOLLOWING, VERIFY_TOKENS), replay.evidence(prefix, FOLLOWING, 2)
    assert prefills == [len(prefix)]
    assert (wide.fp32_top1, wide.fp32_top2, wide.fp32_gaps) == (narrow.fp32_top1, narrow.fp32_top2, narrow.fp32_gaps)


def test_a_reserved_size_builds_each_model_once_for_every_prompt_length(replay_and_prompt, monkeypatch):
    """With the longest prompt known up front, a shorter prompt judged first does not leave a pool that the
    longer one must rebuild (on an 8B target each build loads the model again)."""
    from bench.reproduce import fp32_rerun as rerun_module
    from bench.reproduce import replay as replay_module

    _, prompt = replay_and_prompt
    long_prompt = (prompt * 40)[:600]  # longer than the short one's pool would hold, page for page
    builds: list[int] = []
    build_engine, runtime_class = rerun_module.build_engine, replay_module.TargetRuntime

    def counted_engine(settings: DiffSpecSettings):  # noqa: ANN202
        builds.append(settings.num_pages)
        return build_engine(settings)

    def counted_runtime(settings: DiffSpecSettings) -> TargetRuntime:
        builds.append(-settings.num_pages)
        return runtime_class(settings)

    monkeypatch.setattr(rerun_module, "build_engine", counted_engine)
    monkeypatch.setattr(replay_module, "TargetRuntime", counted_runtime)
    settings = DiffSpecSettings(**SMALL_BUCKETS)
    for reserve, expected_builds in ((0, 4), (len(long_prompt), 2)):
        builds.clear()
        replay = TargetReplay(BUNDLED_TARGET, torch.float32, torch.device("cpu"), settings, reserve + 4)
        rerun = Fp32Rerun(settings, reserve)
        try:
            for ids in (prompt, long_prompt):
                replay.serving_spread(ids, FOLLOWING, VERIFY_TOKENS)
                rerun.diverges([ids], DraftOptions("full", "16:0.0:4"), 4)
        finally:
            rerun.close()
        assert len(builds) == expected_builds, builds


def test_the_fp32_auto_runs_logprobs_are_the_fp32_replays_evidence(replay_and_prompt):
    """Where the fp32 Auto run generated the shared tokens, its top tokens at the next position are what the
    transformers replay of that prefix finds, gaps included; where it took another way, it has none."""
    replay, prompt = replay_and_prompt
    rerun = Fp32Rerun(DiffSpecSettings(num_pages=256))
    try:
        run = rerun.auto_run(prompt, 6)
    finally:
        rerun.close()
    assert len(run.token_ids) == len(run.logprobs) == 6
    for position in (0, 4):
        shared = run.token_ids[:position]
        values, ids = run.top_after(shared)
        replayed = torch.topk(replay.fp32_logits(prompt + shared), len(ids))
        assert ids.tolist() == replayed.indices.tolist() and int(ids[0]) == run.token_ids[position]
        assert (values[0] - values).tolist() == pytest.approx((replayed.values[0] - replayed.values).tolist(), abs=1e-4)
    assert run.top_after([run.token_ids[0] + 1]) is None  # another first token: not this run's prefix
    assert run.top_after(run.token_ids) is None  # past the run's end
