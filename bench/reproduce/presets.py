"""What each preset runs. ``custom`` starts from ``smoke`` and takes every flag as given."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from bench.reproduce.arms import AUTO, BASELINE_TREE_CONFIG, EAGLE3, EAGLE3_SALIENCE
from diffspec.settings import SHARED_DIR
from draft_service.tree_plan import CANDIDATE_GRID


@dataclass(frozen=True)
class ProtocolConfig:
    preset: str
    base_model: Path | None  # None = the settings' (DIFFSPEC_BASE_MODEL or the bundled demo target)
    draft_model: Path | None  # None = the settings' (DIFFSPEC_DRAFT_MODEL or the bundled demo head)
    data_files: tuple[Path, ...]  # empty = the shared long-context prompts
    context_targets: tuple[int, ...]  # prompt tokens per evaluated context
    candidate_configs: tuple[str, ...]  # DiffSpec tree budgets tuned over, total:threshold:depth
    policies: tuple[str, ...]  # DiffSpec tree policies tuned over
    tune_max_new_tokens: int
    eval_max_new_tokens: int
    prompts: int  # evaluation prompts per context
    tune_prompts: int  # tuning prompts per context (taken after the evaluation prompts when the data allows)
    temperature: float
    seed: int
    baseline_arms: tuple[str, ...] = (AUTO, EAGLE3, EAGLE3_SALIENCE)  # compared beside DiffSpec tuned
    baseline_config: str = BASELINE_TREE_CONFIG  # tree budget of the EAGLE-3 baseline arms
    salience_candidates: tuple[bool, ...] = (True,)  # working set settings tuned over: on, or also off (whole context)
    # best first-pass candidates run again on every tuning prompt with eval_max_new_tokens, the fastest
    # of them evaluated (0: the first pass chooses)
    tune_finalists: int = 0
    warmup_tokens: int = 8  # per arm and context, untimed, before any timed run
    reference_prompts: int = 2  # transformers generate on this many evaluated prompts of the shortest context (0: none)
    inflate_8b: bool = False
    shared_dir: Path = SHARED_DIR  # ../shared beside the repo: default data files and tools/inflate.py
    out_dir: Path | None = None  # None = results/<preset>_<timestamp>/
    resume: bool = False  # continue the run recorded in out_dir, reusing its finished runs (checkpoint.py)
    profile_window: bool = False  # bracket the first evaluated prompt (all arms) for Nsight Systems
    # attention of the exactness rule's fp32 runs (None: the serving settings'); at 32K-64K on an 8B target their
    # prefills are most of the judging's time, and which backend prefills fp32 faster is measured by bench.fp32_cost
    fp32_attention_backend: str | None = None
    # judging time after which a divergence not yet judged is left "unchecked" (each costs fp32 runs, a minute and
    # more at 64K on an 8B target), so a run held to a machine's time still writes its report; None: no limit
    judge_minutes: float | None = None
    # every context evaluates and tunes on the prompts long enough for the longest context any prompt fills, cut
    # to it: a ratio across contexts (tau(64K) / tau(4K)) then compares the same texts; off, each context takes
    # the first prompts that fill it, so short contexts also draw on prompts too short for long ones
    same_prompts: bool = False
    # CONTEXT=N: that context tunes on N prompts instead of tune_prompts. A short context's runs are cheap and
    # four prompts rank candidates within a few percent no better than chance: more of them rank them closer.
    # With same_prompts, the tuning prompts past those that fill the longest context are texts that fill this one.
    tune_prompts_at: tuple[str, ...] = ()

    def tune_prompts_for(self, context: int) -> int:
        """Tuning prompts at ``context``: its ``tune_prompts_at`` entry, else ``tune_prompts``."""
        return dict(parse_tune_prompts_at(self.tune_prompts_at)).get(context, self.tune_prompts)


def parse_tune_prompts_at(entries: tuple[str, ...]) -> list[tuple[int, int]]:
    """(context, prompts) of each ``CONTEXT=N`` entry; a malformed one, a count under 1 or a context given twice
    raises ValueError."""
    parsed = []
    for entry in entries:
        context, sep, count = entry.partition("=")
        if not (sep and context.strip().isdigit() and count.strip().isdigit()) or int(count) < 1:
            raise ValueError(f"--tune-prompts-at {entry!r}: CONTEXT=N with N at least 1, e.g. 4096=8")
        parsed.append((int(context), int(count)))
    contexts = [context for context, _ in parsed]
    if len(set(contexts)) < len(contexts):
        raise ValueError(f"--tune-prompts-at {' '.join(entries)}: a context given twice")
    return parsed


SMOKE = ProtocolConfig(
    preset="smoke", base_model=None, draft_model=None, data_files=(), context_targets=(4096,),
    candidate_configs=("32:0.0:6", "64:0.0:8"), policies=("online",), tune_max_new_tokens=32,
    eval_max_new_tokens=64, prompts=1, tune_prompts=1, temperature=0.0, seed=0,
)

FULL = replace(
    SMOKE, preset="full", context_targets=(4096, 16384, 32768, 65536, 131072),
    candidate_configs=tuple(budget.config for budget in CANDIDATE_GRID), policies=("online", "full"),
    salience_candidates=(True, False),  # where the context is short, drafting over all of it can be the faster
    tune_max_new_tokens=64, eval_max_new_tokens=128, prompts=8, tune_prompts=2,  # 128: as every speed table in bench/RESULTS.md
    tune_finalists=3,  # 64 tokens on 2 prompts (12-25 verification steps) rank candidates within a few % by noise
    same_prompts=True,
)

PRESETS = {"smoke": SMOKE, "full": FULL, "custom": SMOKE}


def default_out_dir(preset: str, started: float) -> Path:
    """results/<preset>_<YYYYmmdd-HHMMSS>/ under the working directory."""
    import time

    return Path("results") / f"{preset}_{time.strftime('%Y%m%d-%H%M%S', time.localtime(started))}"
