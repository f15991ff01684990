"""The whole protocol on one engine: for each dataset and context, warm up, tune DiffSpec over the
grid, evaluate Auto and every arm on the same prompts (at the shortest context, ``transformers``
``generate`` too), then judge exactness and write the report.

Per (dataset, context) the evaluation prompts are the first ``prompts`` that fill the context; the
tuning prompts come after them when the data has enough, so the chosen configuration is not tuned
on the prompts it is judged on (with too few prompts, tuning reuses the evaluation prompts and the
log says so).

End-to-end figures need every evaluated prefill cold. The target and the draft keep prefix caches by
client (the cache scope), so each evaluated run is a client of its own, whatever ran before it; warm-up
and tuning run on the tuning prompts. The tuning runs of a context share one scope, and a 64K prompt's
prefill is most of a run: a tuning prompt's candidates take its prompt from both caches. The decode the
tuning scores is not the same cold and warm: the draft ingests the prompt after the first token, so a cold
run's first step holds the head's pass over the whole prompt (at 64K with the 8B-shaped head about 20% of a
128-token decode), which a warm run loads from the draft's prefix cache. So each tuning prompt is primed
in each round, one untimed ``PRIME_TOKENS`` request in the tuning scope, and every candidate is scored warm.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from tqdm import tqdm
from transformers.utils import logging as transformers_logging

from bench.reproduce import arms as arm_names
from bench.reproduce.arms import Arm, baseline_arms, tuning_grid
from bench.reproduce.checkpoint import RunCheckpoint, run_key
from bench.reproduce.draft_steps import DraftStep, build_recording_engine, take_draft_steps
from bench.reproduce.exactness import Divergence, ExactnessResult, first_divergence
from bench.reproduce.fp32_rerun import Fp32Rerun
from bench.reproduce.inflate import inflate_pair
from bench.reproduce.judging import Judge, JudgingLimit, pending
from bench.reproduce.output import write_outputs
from bench.reproduce.presets import ProtocolConfig, default_out_dir
from bench.reproduce.profiling import nvtx_range, profiled
from bench.reproduce.prompts import Dataset, load_datasets, prompts_at
from bench.reproduce.reference import REFERENCE, TransformersReference
from bench.reproduce.replay import TargetReplay
from bench.reproduce.report import ArmSummary, summarise
from bench.reproduce.runs import Engine, RunRecord, generate_run
from bench.reproduce.tuning import (
    CandidateScore,
    finalists,
    score_candidates,
    score_finalists,
    seconds_per_step,
    stalled_phase,
    stalled_runs,
)
from bench.warmup import warm_up_draft, warm_up_draft_over, warm_up_generations, warm_up_target
from diffspec.devices import free_gpu_memory
from diffspec.heap import freeze_startup_heap
from diffspec.sampling import SamplingParams
from diffspec.settings import DiffSpecSettings
from draft_service.options import DraftOptions
from gateway.assembly import load_tokenizer

log = logging.getLogger("bench.reproduce")
# where and how a run writes or judges, not what it measures
NOT_FINGERPRINTED = ("out_dir", "resume", "profile_window", "fp32_attention_backend", "judge_minutes")
SLACK_TOKENS = 64  # context kept free beyond max_new_tokens for a last step's tree
PRIME_TOKENS = 3  # a priming request's: the prefill's token, then the draft starts (with two left) and one verify


@dataclass
class ProtocolResult:
    out_dir: Path
    runs: list[RunRecord]  # tuning (first pass and final round) and evaluation runs, in the order they ran
    scores: list[CandidateScore]  # the tuning pass, both rounds' figures, chosen candidates marked
    summaries: list[ArmSummary]  # evaluation, per (dataset, context, arm)
    exit_code: int  # 0, or 1 when an engine arm's tokens differ from Auto's by more than a near-tie
    warmup_draft_steps: list[WarmupSteps]  # the untimed warm-ups' draft steps, where they ran


@dataclass(frozen=True)
class WarmupSteps:
    """Draft steps of the warm-up generations that ran just before ``runs[before_run]``: with them, the
    runs' steps replay every observation the draft's global hazard prior received, in order."""

    before_run: int  # index into ProtocolResult.runs
    steps: list[DraftStep]

    def to_dict(self) -> dict:
        return {"before_run": self.before_run, "steps": [step.to_list() for step in self.steps]}


class BesideAuto(NamedTuple):
    """An evaluated arm's run, Auto's run of the same prompt, and where the arm's tokens first leave Auto's."""

    run: RunRecord
    auto: RunRecord
    divergence: Divergence | None  # None: the same tokens


def shortest_prompts_first(
    judged: list[BesideAuto], prompt_ids: dict[tuple[str, int, int], list[int]]
) -> list[BesideAuto]:
    """``judged`` in the order the judging takes them: the shortest prompts first (each length's runs in their
    order), so a judging that ``--judge-minutes`` cuts short leaves the fewest divergences unchecked. On an 8B
    target a 64K prompt's fp32 Auto run takes a minute and a half, a 16K prompt's a fraction of that."""
    return sorted(judged, key=lambda b: len(prompt_ids[b.run.dataset, b.run.context, b.run.prompt]))


@dataclass(frozen=True)
class Case:
    """One (dataset, context) with its prompts."""

    dataset: str
    context: int
    eval_prompts: list[tuple[int, list[int]]]  # (index in the dataset, prompt ids)
    tune_prompts: list[tuple[int, list[int]]]


def run_protocol(
    config: ProtocolConfig, argv: list[str],
    engine_factory: Callable[[DiffSpecSettings], Engine] = build_recording_engine,
) -> ProtocolResult:
    started = time.time()
    out_dir = config.out_dir or default_out_dir(config.preset, started)
    out_dir.mkdir(parents=True, exist_ok=True)
    handlers = _log_to(out_dir / "reproduce.log")
    try:
        log.info("python -m bench.reproduce %s", " ".join(argv))
        settings = model_settings(config)
        transformers_logging.set_verbosity_error()  # long prompts are cut to the context after tokenising
        transformers_logging.disable_progress_bar()  # the reference's and the replay's model loads
        tokenizer = load_tokenizer(settings)
        datasets = load_datasets(list(config.data_files) or [config.shared_dir / "data" / "longctx_eval.jsonl"],
                                 lambda text: tokenizer(text)["input_ids"])
        longest = max((len(ids) for d in datasets for ids in d.prompt_ids), default=0)
        contexts = [c for c in config.context_targets if c <= longest]
        settings = settings.model_copy(update={"num_pages": pages_for(settings, max(contexts, default=0), config)})
        checkpoint = RunCheckpoint(out_dir, protocol_fingerprint(config, settings), config.resume, fingerprint_defaults())
        if config.resume:
            log.info("resuming: %d runs recorded in %s", checkpoint.num_done, out_dir)
        # the protocol holds the only reference to the engine, so that closing it frees the GPU for the replays
        def write(result: ProtocolResult) -> None:
            write_outputs(result, config, settings, argv, started)

        protocol = _Protocol(config, engine_factory(settings), settings, out_dir, checkpoint, write_report=write)
        result = asyncio.run(protocol.run(datasets, contexts))
        write(result)
        return result
    finally:
        for handler in handlers:
            logging.getLogger().removeHandler(handler)
            handler.close()


def model_settings(config: ProtocolConfig) -> DiffSpecSettings:
    """The settings (DIFFSPEC_* env included) with the flags' models, or the 8B-shaped pair built from them."""
    settings = DiffSpecSettings()
    base, draft = config.base_model or settings.base_model, config.draft_model or settings.draft_model
    if config.inflate_8b:
        base, draft = inflate_pair(config.shared_dir, base, draft)
        log.info("8B-shaped pair: target %s, head %s", base, draft)
    return settings.model_copy(update={"base_model": base, "draft_model": draft})


def protocol_fingerprint(config: ProtocolConfig, settings: DiffSpecSettings) -> dict:
    """What decides a run's records: the protocol's fields and the engine's settings, not where it writes."""
    measured = {k: v for k, v in asdict(config).items() if k not in NOT_FINGERPRINTED}
    return json.loads(json.dumps({**measured, "settings": settings.model_dump(mode="json")}, default=str))


def fingerprint_defaults() -> dict:
    """The protocol fields' and the engine settings' defaults as ``protocol_fingerprint`` writes them (the
    fields that have one)."""
    defaults = {f.name: f.default for f in fields(ProtocolConfig)
                if f.default is not MISSING and f.name not in NOT_FINGERPRINTED}
    settings = {name: field.get_default(call_default_factory=True)
                for name, field in DiffSpecSettings.model_fields.items() if not field.is_required()}
    return json.loads(json.dumps({**defaults, "settings": settings}, default=str))


def pages_for(settings: DiffSpecSettings, context: int, config: ProtocolConfig) -> int:
    """KV pages for two sequences of the longest context plus generation, and never fewer than set."""
    tokens = context + max(config.eval_max_new_tokens, config.tune_max_new_tokens) + 2 * SLACK_TOKENS
    return max(settings.num_pages, 2 * -(-tokens // settings.page_size) + 64)


def cases_of(config: ProtocolConfig, datasets: list[Dataset], contexts: list[int], max_context: int) -> list[Case]:
    """Each (dataset, context) the protocol runs, with its evaluation and tuning prompts: contexts some prompt
    fills (``contexts``) whose generation fits the target's ``max_context``."""
    cases = []
    room = max(config.eval_max_new_tokens, config.tune_max_new_tokens) + SLACK_TOKENS
    fitting = [c for c in config.context_targets if c in contexts and c + room <= max_context]
    for dataset in datasets:
        # with same_prompts every context takes the texts long enough for the longest one any prompt fills
        filled = [c for c in fitting if prompts_at(dataset, c, 0, 1)] if config.same_prompts else []
        long_enough_for = max(filled, default=None)
        for context in config.context_targets:
            if context not in fitting:
                log.warning("%s: context %d skipped (longest prompt or the target's %d-token limit)",
                            dataset.name, context, max_context)
                continue
            evaluated = prompts_at(dataset, context, 0, config.prompts, long_enough_for)
            if not evaluated:
                log.warning("%s: no prompt fills %d tokens; context skipped", dataset.name, context)
                continue
            if len(evaluated) < config.prompts:
                log.warning("%s: only %d prompts fill %d tokens", dataset.name, len(evaluated), context)
            tuning = tuning_prompts(dataset, context, evaluated[-1][0] + 1, config.tune_prompts_for(context),
                                    long_enough_for)  # fmt: skip
            if not tuning:
                log.warning("%s @ %d: no prompt left for tuning; tuning on the evaluation prompts, so Auto's "
                            "prefill may hit the prefix cache and its end-to-end figure is flattered",
                            dataset.name, context)
                tuning = evaluated[: config.tune_prompts_for(context)]
            cases.append(Case(dataset.name, context, evaluated, tuning))
    if not cases:
        raise SystemExit("no (dataset, context) pair has prompts long enough: lower --context-targets")
    return cases


def tuning_prompts(
    dataset: Dataset, context: int, first: int, count: int, long_enough_for: int | None
) -> list[tuple[int, list[int]]]:
    """Up to ``count`` tuning prompts from index ``first`` on: the texts long enough for ``long_enough_for`` first
    (those every context tunes on), then, where they run out, other texts that fill ``context``; each in index
    order."""
    chosen = prompts_at(dataset, context, first, count, long_enough_for)
    if len(chosen) < count and long_enough_for is not None:
        taken = {index for index, _ in chosen}
        more = [p for p in prompts_at(dataset, context, first, count + len(taken)) if p[0] not in taken]
        chosen += more[: count - len(chosen)]
    return chosen


class _Protocol:
    def __init__(
        self, config: ProtocolConfig, engine: Engine, settings: DiffSpecSettings, out_dir: Path,
        checkpoint: RunCheckpoint, write_report: Callable[[ProtocolResult], None] | None = None,
    ) -> None:
        """``write_report``: writes the report of a result; called once before a judging that has divergences
        to replay, so a machine that goes away during the replays (minutes each at 64K) leaves the tables."""
        self.config = config
        self.write_report = write_report
        self.checkpoint = checkpoint  # runs an earlier process finished (--resume), and where each new one goes
        self.settings = settings  # the engine's: the exactness replays and the fp32 rerun build from them
        self.base_model = settings.base_model
        self.engine = engine
        self.out_dir = out_dir
        self.sampling = SamplingParams(temperature=config.temperature, seed=config.seed)
        fixed = baseline_arms(config.baseline_config)
        # Auto always, and first on every prompt: every speedup is over it, and its prefill must be cold
        self.baselines = [fixed[arm_names.AUTO]] + [fixed[n] for n in config.baseline_arms if n != arm_names.AUTO]
        self.candidates = tuning_grid(list(config.policies), list(config.candidate_configs), config.salience_candidates)
        self.runs: list[RunRecord] = []
        self.scores: list[CandidateScore] = []
        self.chosen: dict[tuple[str, int], Arm] = {}
        self.arm_of = {arm.label: arm for arm in self.baselines + self.candidates}
        self.prompt_ids: dict[tuple[str, int, int], list[int]] = {}  # (dataset, context, prompt) -> ids
        self.warmup_draft_steps: list[WarmupSteps] = []
        self.reference: TransformersReference | None = None  # set in run() once the target's dtype is known

    async def run(self, datasets: list[Dataset], contexts: list[int]) -> ProtocolResult:
        torch.manual_seed(self.config.seed)
        info = await self.engine.target_info()
        log.info("target %s (%s, %s), max context %d", info.model, info.device, info.dtype, info.max_context)
        cases = cases_of(self.config, datasets, contexts, info.max_context)
        shortest = min(case.context for case in cases)
        if self.config.reference_prompts > 0 and not self.sampling.greedy:
            log.info("no transformers reference above temperature 0: it generates greedily")
        elif self.config.reference_prompts > 0:
            self.reference = TransformersReference(
                self.base_model, _torch_dtype(info.dtype), torch.device(info.device), info.eos_token_ids)
        if any(self._has_runs_left(case, shortest) for case in cases):  # a resumed run with none left only judges
            log.info("recorded %d target step graphs, proposed %d warm-up trees", warm_up_target(self.engine),
                     warm_up_draft(self.engine))
            freeze_startup_heap()  # as a server does once it is up (diffspec/heap.py); the close thaws it
        tuning_arms = len(self.candidates) + min(self.config.tune_finalists, len(self.candidates))  # first pass, final
        total = sum(len(c.tune_prompts) * tuning_arms + len(c.eval_prompts) * (len(self.baselines) + 1)
                    + (len(self._reference_prompts(c)) if self.reference and c.context == shortest else 0)
                    for c in cases)
        warmed: set[int] = set()
        with tqdm(total=total, unit="run", desc="reproduce", dynamic_ncols=True) as bar:
            for case in cases:
                if case.context not in warmed and self._has_runs_left(case, shortest):
                    # on a tuning prompt: the prefix cache must not hold an evaluated one
                    bar.set_postfix_str(f"warm-up {case.context}")
                    drafts = [a.draft for a in self.baselines + self.candidates]
                    await warm_up_generations(self.engine, case.tune_prompts[0][1], drafts, self.config.warmup_tokens)
                    new_tokens = max(self.config.tune_max_new_tokens, self.config.eval_max_new_tokens)
                    log.info("proposed %d warm-up trees over a whole %d-token context",
                             warm_up_draft_over(self.engine, case.context, new_tokens), case.context)
                    self.warmup_draft_steps.append(WarmupSteps(len(self.runs), take_draft_steps(self.engine)))
                    warmed.add(case.context)
                await self._tune(case, bar)
                await self._evaluate(case, bar)
                if self.reference is not None and case.context == shortest:
                    self._evaluate_reference(self.reference, case, bar)
        if self.reference is not None:
            self.reference.close()
        close = getattr(self.engine, "close", None)  # stop the engine's thread before the replays load a model
        if close is not None:
            close()
        del self.engine, close  # the bound method holds the engine too: kept, its model and pool outlive the judging
        free_gpu_memory()  # the serving pool's blocks, before the judging's models load
        if self.write_report is not None and self._verdicts_before_judging():
            self.write_report(self._result(exit_code=0))
        # on a thread of its own: the fp32 run behind a near-tie drives an engine with asyncio.run of its own
        exit_code = await asyncio.to_thread(self._judge_exactness, info.dtype)
        return self._result(exit_code)

    def _result(self, exit_code: int) -> ProtocolResult:
        evaluated = [r for r in self.runs if r.phase == "eval"]
        return ProtocolResult(self.out_dir, self.runs, self.scores, summarise(evaluated), exit_code,
                              self.warmup_draft_steps)

    def _beside_auto(self) -> list[BesideAuto]:
        """Every evaluated arm's run with Auto's run of the same prompt and where their tokens first differ."""
        evaluated = [r for r in self.runs if r.phase == "eval"]
        auto = {(r.dataset, r.context, r.prompt): r for r in evaluated if r.arm == arm_names.AUTO}
        pairs = [(run, auto[run.dataset, run.context, run.prompt]) for run in evaluated if run.arm != arm_names.AUTO]
        return [BesideAuto(run, auto_run, first_divergence(auto_run.token_ids, run.token_ids))
                for run, auto_run in pairs]

    def _verdicts_before_judging(self) -> int:
        """Each evaluated run's verdict as far as it is known before the replays: recorded, exact (Auto's tokens),
        or not judged yet (``judging.pending``). Returns how many await the judging."""
        waiting = 0
        for run, _, divergence in self._beside_auto():
            run.exactness = self.checkpoint.verdict(run_key(run))
            if run.exactness is None:
                run.exactness = pending(divergence) if divergence is not None else ExactnessResult(
                    "exact", "same tokens as Auto")
                waiting += divergence is not None
        return waiting

    def _has_runs_left(self, case: Case, shortest: int) -> bool:
        """Whether any run of ``case`` is still to generate, not recorded by an earlier process (``--resume``):
        its warm-up is skipped otherwise. The final round's runs count once the recorded first pass picks its
        finalists, and the tuned arm's once the recorded tuning runs choose it."""
        tuned = [self._recorded("tune", case, prompt, arm) for prompt in case.tune_prompts for arm in self.candidates]
        if any(run is None for run in tuned):
            return True
        scores = score_candidates(self.candidates, tuned)
        shortlist = finalists(self.candidates, scores, self.config.tune_finalists)
        finals = [self._recorded("final", case, prompt, arm) for prompt in case.tune_prompts for arm in shortlist]
        if any(run is None for run in finals):
            return True
        labels = [arm.label for arm in (*self.baselines, self._choose(scores, finals)[1])]
        evaluated = [(prompt, label) for prompt in case.eval_prompts for label in labels]
        if self.reference is not None and case.context == shortest:
            evaluated += [(prompt, self.reference.label) for prompt in self._reference_prompts(case)]
        return any(self._recorded("eval", case, prompt, label) is None for prompt, label in evaluated)

    def _choose(self, scores: list[CandidateScore], finals: list[RunRecord]) -> tuple[list[CandidateScore], Arm]:
        """The first pass's ``scores`` with the final round's figures of its ``finals`` (none: the first pass
        chooses), and the candidate they choose."""
        if finals:
            scores = score_finalists(scores, finals)
        return scores, next(arm for arm, score in zip(self.candidates, scores) if score.chosen)

    def _recorded(self, phase: str, case: Case, prompt: tuple[int, list[int]], arm: Arm | str) -> RunRecord | None:
        label = arm if isinstance(arm, str) else arm.label
        return self.checkpoint.done((phase, case.dataset, case.context, prompt[0], label))

    async def _run(
        self, bar: tqdm, phase: str, case: Case, prompt: tuple[int, list[int]], arm: Arm, n: int, again: bool = False
    ) -> RunRecord:
        """``arm`` on ``prompt``, or its recorded run; ``again``: generated whatever was recorded (a stalled run's
        replacement)."""
        done = self._recorded(phase, case, prompt, arm)
        if done is not None and not again:
            return self._record(bar, phase, case, prompt, done)
        with nvtx_range(f"{phase} {case.context} p{prompt[0]} {arm.label}"):
            scope = None if phase == "eval" else self._tuning_scope(case)  # the module's docstring
            run = await generate_run(self.engine, prompt[1], arm, n, self.sampling, scope)
        self._record(bar, phase, case, prompt, run)
        self.checkpoint.record(run)
        return run

    def _record(self, bar: tqdm, phase: str, case: Case, prompt: tuple[int, list[int]], run: RunRecord) -> RunRecord:
        run.phase, run.dataset, run.context, run.prompt = phase, case.dataset, case.context, prompt[0]
        self.prompt_ids[(case.dataset, case.context, prompt[0])] = prompt[1]
        self.runs.append(run)
        bar.update()
        log.info("%s %s ctx=%d prompt=%d %s: tau=%.2f decode=%.1f tok/s e2e=%.1f tok/s", phase, case.dataset,
                 case.context, prompt[0], run.label, run.stats.mean_accepted_length,
                 run.stats.decode_tokens_per_second, run.end_to_end_tokens_per_second)
        if run.kernels_compiled:
            log.warning("%s ctx=%d prompt=%d %s compiled %d Triton kernels inside its timing (a warm-up gap): %s",
                        phase, case.context, prompt[0], run.label, run.kernels_compiled, ", ".join(run.compiled_kernels))
        return run

    async def _tune(self, case: Case, bar: tqdm) -> None:
        bar.set_postfix_str(f"tune {case.dataset} {case.context}")
        tuned = await self._tuning_round("tune", case, self.candidates, self.config.tune_max_new_tokens, bar)
        scores = score_candidates(self.candidates, tuned)
        shortlist = finalists(self.candidates, scores, self.config.tune_finalists)
        bar.set_postfix_str(f"final {case.dataset} {case.context}")
        # the finalists again, paired on the same prompts, with as many tokens as the evaluation
        finals = await self._tuning_round("final", case, shortlist, self.config.eval_max_new_tokens, bar)
        scores, best = self._choose(scores, finals)
        self.scores += scores
        self.chosen[(case.dataset, case.context)] = best
        log.info("tuned %s @ %d: %s", case.dataset, case.context, best.label)

    async def _tuning_round(self, phase: str, case: Case, arms: list[Arm], n: int, bar: tqdm) -> list[RunRecord]:
        """Every arm on every tuning prompt, each prompt primed first (the module's docstring); a stalled run
        again, once (``tuning.stalled_runs``)."""
        runs = []
        for prompt in case.tune_prompts:
            if any(self._recorded(phase, case, prompt, arm) is None for arm in arms):
                await self._prime(case, prompt, arms[0])
            runs += [await self._run(bar, phase, case, prompt, arm, n) for arm in arms]
        for stalled in stalled_runs(runs):
            log.warning("%s ctx=%d prompt=%d %s stalled (%.1f ms a step; garbage collection %.3f s, allocator "
                        "retries %d): run again", phase, case.context, stalled.prompt, stalled.label,
                        1e3 * seconds_per_step(stalled), stalled.gc_seconds, stalled.allocator_retries)
            prompt, arm = next(p for p in case.tune_prompts if p[0] == stalled.prompt), self.arm_of[stalled.label]
            await self._prime(case, prompt, arm)
            stalled.phase = stalled_phase(phase)
            self.checkpoint.record(stalled)  # kept under its own phase; the run again takes the phase's key
            bar.total = (bar.total or 0) + 1  # the bar counts every run the record holds
            runs[runs.index(stalled)] = await self._run(bar, phase, case, prompt, arm, n, again=True)
        return runs

    async def _prime(self, case: Case, prompt: tuple[int, list[int]], arm: Arm) -> None:
        """Fill both prefix caches with ``prompt`` in the tuning scope: an untimed request with ``arm``'s working
        set under the ``full`` policy, which leaves the ``online`` sessions' shared estimates as they were."""
        assert arm.draft is not None
        draft = DraftOptions("full", arm.draft.tree_config, salience=arm.draft.salience)
        with nvtx_range(f"prime {case.context} p{prompt[0]}"):
            await warm_up_generations(self.engine, prompt[1], [draft], PRIME_TOKENS, client=self._tuning_scope(case))
        take_draft_steps(self.engine)  # the recording engine's steps of the prime: no run's

    @staticmethod
    def _tuning_scope(case: Case) -> str:
        return f"tuning/{case.dataset}/{case.context}"

    async def _evaluate(self, case: Case, bar: tqdm) -> None:
        bar.set_postfix_str(f"eval {case.dataset} {case.context}")
        arms = self.baselines + [self.chosen[(case.dataset, case.context)]]
        profile = self.config.profile_window and not any(r.phase == "eval" for r in self.runs)
        for i, prompt in enumerate(case.eval_prompts):
            with profiled(profile and i == 0):
                for arm in arms:
                    await self._run(bar, "eval", case, prompt, arm, self.config.eval_max_new_tokens)

    def _reference_prompts(self, case: Case) -> list[tuple[int, list[int]]]:
        return case.eval_prompts[: self.config.reference_prompts]

    def _evaluate_reference(self, reference: TransformersReference, case: Case, bar: tqdm) -> None:
        """``transformers`` ``generate`` on the first evaluated prompts, after one untimed warm-up generation."""
        bar.set_postfix_str(f"{REFERENCE} {case.dataset} {case.context}")
        if any(self._recorded("eval", case, p, reference.label) is None for p in self._reference_prompts(case)):
            reference.generate(case.tune_prompts[0][1], self.config.warmup_tokens)
        for prompt in self._reference_prompts(case):
            done = self._recorded("eval", case, prompt, reference.label)
            if done is not None:
                self._record(bar, "eval", case, prompt, done)
                continue
            with nvtx_range(f"eval {case.context} p{prompt[0]} {reference.label}"):
                run = reference.generate(prompt[1], self.config.eval_max_new_tokens)
            self._record(bar, "eval", case, prompt, run)
            self.checkpoint.record(run)

    def _judge_exactness(self, serving_dtype: str) -> int:
        """Verdicts for every evaluated arm against Auto's run of the same prompt; 1 on any engine arm's
        mismatch. The outside reference is judged by the same rule, but its mismatch is a warning: its
        kernels round differently from the engine's at every position, not only where a tree is verified."""
        judged = shortest_prompts_first(self._beside_auto(), self.prompt_ids)
        diverging = [b.run for b in judged
                     if b.divergence is not None and self.checkpoint.verdict(run_key(b.run)) is None]
        # each model loads once, at the size of the longest prompt to judge
        longest = max((len(self.prompt_ids[r.dataset, r.context, r.prompt]) for r in diverging), default=0)
        replay = TargetReplay(self.base_model, _torch_dtype(serving_dtype), _device(), self.settings,
                              longest + self.config.eval_max_new_tokens)  # a prefix: the prompt and shared tokens
        backend = self.config.fp32_attention_backend
        fp32_settings = self.settings if backend is None else self.settings.model_copy(update={"attention_backend": backend})
        judge = Judge(replay, Fp32Rerun(fp32_settings, longest, sampling=self.sampling))
        limit = JudgingLimit(self.config.judge_minutes)
        for run, auto, divergence in tqdm(judged, unit="run", desc="judge", dynamic_ncols=True):
            run.exactness = self.checkpoint.verdict(run_key(run))
            if run.exactness is None and divergence is not None and limit.reached():
                run.exactness = limit.unchecked(divergence)  # not recorded: --resume judges it
            elif run.exactness is None:
                started = time.perf_counter()
                run.exactness = self._verdict(judge, run, auto, self.prompt_ids[run.dataset, run.context, run.prompt])
                self.checkpoint.record_verdict(run_key(run), run.exactness)
                if run.exactness.verdict != "exact":
                    log.info("judged %s ctx=%d prompt=%d %s: %s (%s) in %.1f s", run.dataset, run.context, run.prompt,
                             run.label, run.exactness.verdict, run.exactness.reason, time.perf_counter() - started)
            if run.exactness.verdict == "mismatch":
                assert run.exactness.divergence is not None
                report = log.warning if run.arm == REFERENCE else log.error
                report("%s: %s ctx=%d prompt=%d %s diverges from Auto at token %d: %s",
                       "REFERENCE DIFFERS" if run.arm == REFERENCE else "EXACTNESS FAILED", run.dataset,
                       run.context, run.prompt, run.label, run.exactness.divergence.position, run.exactness.reason)
        judge.close()
        if limit.left_unchecked:
            log.warning("judging stopped after %.1f minutes (--judge-minutes): %d divergences unchecked; --resume "
                        "judges them", self.config.judge_minutes, limit.left_unchecked)
        return int(any(b.run.exactness is not None and b.run.exactness.verdict == "mismatch"
                       and b.run.arm != REFERENCE for b in judged))

    def _verdict(self, judge: Judge, run: RunRecord, auto: RunRecord, prompt_ids: list[int]) -> ExactnessResult:
        """The judge's verdict, greedy or sampled: every arm samples with one seed, so its tokens are Auto's too."""
        arm = self.arm_of.get(run.label)
        draft = arm.draft if arm is not None else None  # None: the outside reference, or an arm no longer listed
        tree_config = draft.tree_config if draft is not None else self.config.baseline_config
        verify_tokens = int(tree_config.split(":")[0])  # the budget's total_tokens: its largest verify
        return judge.verdict(prompt_ids, auto.token_ids, run.token_ids, draft, verify_tokens,
                             self.config.eval_max_new_tokens)


def _torch_dtype(name: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' -> torch.bfloat16."""
    return getattr(torch, name.removeprefix("torch."))


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _log_to(path: Path) -> list[logging.Handler]:
    """Log to the run's file, and to the console through tqdm so the bar stays whole."""
    file_handler = logging.FileHandler(path)
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    console = _TqdmHandler()
    console.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for handler in (file_handler, console):
        root.addHandler(handler)
    return [file_handler, console]


class _TqdmHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        tqdm.write(self.format(record))
