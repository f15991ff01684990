"""A wrong accepted token injected into DiffSpec's output is reported as a mismatch, not a near-tie,
and the run fails; the fp32 replay behind the verdict agrees with the engine's Auto."""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace
from typing import AsyncIterator

import torch

from bench.reproduce import judging
from bench.reproduce.presets import SMOKE
from bench.reproduce.protocol import run_protocol
from bench.reproduce.replay import TargetReplay
from diffspec.settings import BUNDLED_TARGET, DiffSpecSettings
from bench.reproduce.draft_steps import build_recording_engine
from gateway.assembly import build_engine, load_tokenizer
from gateway.request import GenerationChunk, GenerationRequest

PLANTED_AT = 5  # generated-token index whose accepted token the bug changes
VOCAB = 8192


class PlantedBugEngine:
    """The real engine, except that drafting requests over the working set (DiffSpec) get one wrong token."""

    def __init__(self, engine) -> None:  # noqa: ANN001 - a RecordingEngine
        self.engine = engine

    async def target_info(self):  # noqa: ANN201
        return await self.engine.target_info()

    def take_draft_steps(self):  # noqa: ANN201
        return self.engine.take_draft_steps()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        planted = request.draft is not None and request.draft.salience and request.draft.policy == "online"
        emitted = 0
        async for chunk in self.engine.generate(request):
            ids = list(chunk.token_ids)
            if planted and emitted <= PLANTED_AT < emitted + len(ids):
                ids[PLANTED_AT - emitted] = (ids[PLANTED_AT - emitted] + 1) % VOCAB
            emitted += len(ids)
            yield replace(chunk, token_ids=ids)

    def close(self) -> None:
        self.engine.close()


def test_planted_wrong_token_is_a_mismatch(code_prompts, tmp_path):
    config = replace(
        SMOKE, data_files=(code_prompts,), context_targets=(1024,), candidate_configs=("32:0.0:6",),
        baseline_arms=("auto", "eagle3"), tune_max_new_tokens=8, eval_max_new_tokens=12, warmup_tokens=4,
        reference_prompts=0, out_dir=tmp_path / "planted",
    )
    result = run_protocol(config, ["--planted-bug"], engine_factory=lambda s: PlantedBugEngine(build_recording_engine(s)))
    assert result.exit_code == 1
    evaluated = {r.arm: r for r in result.runs if r.phase == "eval"}
    assert evaluated["eagle3"].exactness.verdict == "exact"
    verdict = evaluated["diffspec"].exactness
    assert verdict.verdict == "mismatch"
    assert verdict.divergence.position == PLANTED_AT
    assert verdict.divergence.auto_token == evaluated["auto"].token_ids[PLANTED_AT]
    assert verdict.evidence.fp32_top1 == verdict.divergence.auto_token
    summary = next(s for s in result.summaries if s.arm == "diffspec")
    assert (summary.exact, summary.near_ties, summary.mismatches) == (0, 0, 1)
    assert "EXACTNESS FAILED" in (tmp_path / "planted" / "reproduce.log").read_text()


def test_a_planted_sampled_token_is_judged_by_the_sampled_rule_as_a_mismatch(code_prompts, tmp_path):
    """Above temperature 0 every arm samples Auto's tokens with the seed; the planted token is one the seed's
    uniform at its index lies far from, against a cdf spread of float noise (fp32 on the CPU)."""
    config = replace(
        SMOKE, data_files=(code_prompts,), context_targets=(1024,), candidate_configs=("32:0.0:6",),
        baseline_arms=("auto", "eagle3"), tune_max_new_tokens=8, eval_max_new_tokens=12, warmup_tokens=4,
        reference_prompts=1, temperature=0.8, seed=3, out_dir=tmp_path / "sampled",
    )
    result = run_protocol(config, ["--planted-bug"], engine_factory=lambda s: PlantedBugEngine(build_recording_engine(s)))
    assert result.exit_code == 1
    evaluated = {r.arm: r for r in result.runs if r.phase == "eval"}
    assert set(evaluated) == {"auto", "eagle3", "diffspec"}  # the greedy transformers reference does not sample
    assert evaluated["eagle3"].exactness.verdict == "exact"
    verdict = evaluated["diffspec"].exactness
    assert verdict.verdict == "mismatch" and "not both below the serving cdf spread" in verdict.reason
    assert verdict.divergence.position == PLANTED_AT and verdict.evidence is None
    assert 0 <= verdict.sampled_evidence.cdf_spread < 1e-3 and verdict.fp32_run_diverges is None


def test_a_divergence_within_the_spread_is_rerun_in_fp32_from_inside_the_protocol(code_prompts, tmp_path, monkeypatch):
    """The rule's fp32 run starts from the protocol's own event loop: with every divergence made to look as
    close as a tie, the planted one is rerun in fp32 (which does not diverge), and stays a mismatch because
    the planted token is not among the fp32 top tokens."""
    replay_evidence = TargetReplay.evidence
    monkeypatch.setattr(TargetReplay, "evidence", lambda self, *a, **k: replace(replay_evidence(self, *a, **k), spread=1.0))
    monkeypatch.setattr(judging, "rounding_gap", lambda divergence, evidence: 0.0)
    config = replace(
        SMOKE, data_files=(code_prompts,), context_targets=(1024,), candidate_configs=("32:0.0:6",),
        baseline_arms=("auto",), tune_max_new_tokens=8, eval_max_new_tokens=12, warmup_tokens=4,
        reference_prompts=0, out_dir=tmp_path / "near",
    )
    result = run_protocol(config, ["--planted-bug"], engine_factory=lambda s: PlantedBugEngine(build_recording_engine(s)))
    verdict = next(r for r in result.runs if r.phase == "eval" and r.arm == "diffspec").exactness
    assert verdict.fp32_run_diverges is False
    assert verdict.verdict == "mismatch" and "not both among the fp32 top tokens" in verdict.reason
    assert result.exit_code == 1
    log = (tmp_path / "near" / "reproduce.log").read_text()  # where the judging's time went, phase by phase
    for phase in ("serving runtime built", "serving paths after a", "fp32 engine built", "fp32 Auto run of a",
                  "fp32 online 32:0.0:6 run of 1 prompts"):
        assert re.search(rf"judging: {phase}.* in \d+\.\d s", log), phase
    for run in ("fp32 Auto run of a", "fp32 online 32:0.0:6 run of 1 prompts"):  # and how prefill and decode shared it
        split = re.search(rf"judging: {run}[^:\n]*: prefill (\d+\.\d) s, decode (\d+\.\d) s over (\d+) steps", log)
        assert split and int(split.group(3)) >= 1, run
    assert "fp32 reference loaded" not in log  # the fp32 Auto run, which generated the shared tokens, had the logits
    assert re.search(r"judged \S+ ctx=1024 prompt=\d+ diffspec\S* .*: mismatch \(.*\) in \d+\.\d s", log)


def test_replay_agrees_with_the_engines_auto():
    settings = DiffSpecSettings(num_pages=256)
    prompt = load_tokenizer(settings)("import os\nimport sys\n\n\ndef main(argv):")["input_ids"]
    engine = build_engine(settings, with_draft=False)

    async def auto_tokens() -> list[int]:
        tokens: list[int] = []
        async for chunk in engine.generate(GenerationRequest(prompt, 6)):
            tokens += chunk.token_ids
        return tokens

    tokens = asyncio.run(auto_tokens())
    engine.close()
    replay = TargetReplay(BUNDLED_TARGET, torch.float32, torch.device("cpu"))
    for position in (0, 3):
        evidence = replay.evidence(prompt + tokens[:position], tokens[position:], verify_tokens=8)
        assert evidence.fp32_top1 == tokens[position]
        assert evidence.fp32_top2 != evidence.fp32_top1 and evidence.fp32_margin >= 0
        assert 0 <= evidence.spread < 1e-3  # fp32 on the CPU: decode and verify round alike up to float noise
