"""Per (dataset, context, arm) summaries of the evaluation runs, and the markdown report."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

from bench.reproduce.arms import AUTO
from bench.reproduce.policy_pairs import INTERVAL, PolicyPairs
from bench.reproduce.runs import RunRecord
from bench.reproduce.tuning import FINAL_TIE, CandidateScore, decode_tokens_per_second, draft_ms_per_step, tau


@dataclass(frozen=True)
class ArmSummary:
    """One arm at one context of one dataset, summed over its prompts (Auto's runs are the same prompts)."""

    dataset: str
    context: int  # prompt tokens
    arm: str
    label: str  # arm plus its tree
    prompts: int
    prompt_indices: list[int]  # [prompts] the dataset's indices of the prompts, ascending
    new_tokens: int  # summed over prompts
    tau: float  # accepted drafts + 1 bonus per verification step (1.0 for Auto)
    decode_tokens_per_s: float  # tokens after the first / decode seconds
    decode_speedup: float | None  # over Auto's decode tokens/s on the same prompts
    end_to_end_tokens_per_s: float  # all new tokens / client seconds from request to last token
    end_to_end_speedup: float | None  # over Auto's end-to-end tokens/s
    prefill_seconds: float  # mean per prompt, engine-measured
    first_token_seconds: float  # mean per prompt, client-measured (time to first token)
    draft_ms_per_step: float
    verify_ms_per_step: float
    host_ms_per_step: float  # decode time outside draft and verify calls
    stop_depth_histogram: list[int]  # [depth] -> steps whose accepted path stopped there
    working_set_tokens: int  # largest working set the draft attended to
    working_set_updates_per_step: float  # arena updates per verification step: each is host work of its accept
    peak_memory_gib: float | None  # largest peak GPU memory of a run (None on CPU)
    exact: int
    near_ties: int
    mismatches: int
    unchecked: int


def _ratio(mine: float, auto: float) -> float | None:
    return round(mine / auto, 4) if auto > 0 else None


def end_to_end_tokens_per_second(runs: list[RunRecord]) -> float:
    seconds = sum(r.request_seconds for r in runs)
    return sum(r.stats.new_tokens for r in runs) / seconds if seconds > 0 else 0.0


def _histogram(runs: list[RunRecord]) -> list[int]:
    total: list[int] = []
    for r in runs:
        hist = r.stats.stop_depth_histogram
        total += [0] * (len(hist) - len(total))
        total = [t + (hist[d] if d < len(hist) else 0) for d, t in enumerate(total)]
    return total


def summarise_arm(runs: list[RunRecord], auto: list[RunRecord]) -> ArmSummary:
    """``runs`` are one arm's at one (dataset, context), ``auto`` Auto's on the same prompts."""
    first, steps = runs[0], sum(r.stats.steps for r in runs)
    decode_s = sum(r.stats.decode_seconds for r in runs)
    draft_s, verify_s = sum(r.stats.draft_seconds for r in runs), sum(r.stats.verify_seconds for r in runs)
    peaks = [r.peak_memory_bytes for r in runs if r.peak_memory_bytes is not None]
    counts = Counter(r.exactness.verdict for r in runs if r.exactness is not None)
    decode_tps, e2e_tps = decode_tokens_per_second(runs), end_to_end_tokens_per_second(runs)
    return ArmSummary(
        dataset=first.dataset, context=first.context, arm=first.arm, label=first.label, prompts=len(runs),
        prompt_indices=sorted(r.prompt for r in runs), new_tokens=sum(r.stats.new_tokens for r in runs),
        tau=round(tau(runs), 4),
        decode_tokens_per_s=round(decode_tps, 3),
        decode_speedup=_ratio(decode_tps, decode_tokens_per_second(auto)) if auto else None,
        end_to_end_tokens_per_s=round(e2e_tps, 3),
        end_to_end_speedup=_ratio(e2e_tps, end_to_end_tokens_per_second(auto)) if auto else None,
        prefill_seconds=round(sum(r.stats.prefill_seconds for r in runs) / len(runs), 6),
        first_token_seconds=round(sum(r.first_token_seconds for r in runs) / len(runs), 6),
        draft_ms_per_step=round(draft_ms_per_step(runs), 3),
        verify_ms_per_step=round(1000 * verify_s / steps, 3) if steps else 0.0,
        host_ms_per_step=round(1000 * (decode_s - draft_s - verify_s) / steps, 3) if steps else 0.0,
        stop_depth_histogram=_histogram(runs),
        working_set_tokens=max(r.stats.working_set_tokens for r in runs),
        working_set_updates_per_step=round(sum(r.stats.working_set_updates for r in runs) / steps, 3) if steps else 0.0,
        peak_memory_gib=round(max(peaks) / 2**30, 3) if peaks else None,
        exact=counts["exact"], near_ties=counts["near-tie"], mismatches=counts["mismatch"],
        unchecked=counts["unchecked"],
    )


def summarise(runs: list[RunRecord]) -> list[ArmSummary]:
    """One summary per (dataset, context, arm), in run order; speedups over Auto on the arm's own prompts
    (the outside reference runs on the first few only)."""
    summaries = []
    keys = dict.fromkeys((r.dataset, r.context, r.arm) for r in runs)
    for dataset, context, arm in keys:
        at = [r for r in runs if (r.dataset, r.context) == (dataset, context)]
        mine = [r for r in at if r.arm == arm]
        prompts = {r.prompt for r in mine}
        auto = [r for r in at if r.arm == AUTO and r.prompt in prompts]
        summaries.append(summarise_arm(mine, auto))
    return summaries


def _cell(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def tau_by_context_lines(summaries: list[ArmSummary]) -> list[str]:
    """tau at each context and its ratio to the shortest context's, per arm that ran the same prompts at every
    context (the protocol's same-prompt choice), so that the context is the only input that differs. An arm
    whose tree the tuning chose (DiffSpec) may run another tree at each context: the table above names it."""
    contexts = sorted({s.context for s in summaries})
    if len(contexts) < 2:
        return []
    lines = ["| arm | " + " | ".join(f"tau at {c}" for c in contexts) + " | "
             + " | ".join(f"{c} / {contexts[0]}" for c in contexts[1:]) + " |",
             "| --- |" + " --- |" * (2 * len(contexts) - 1)]
    for arm in dict.fromkeys(s.arm for s in summaries if s.arm != AUTO):
        by_context = {s.context: s for s in summaries if s.arm == arm}
        if sorted(by_context) != contexts or len({tuple(s.prompt_indices) for s in by_context.values()}) > 1:
            continue  # not at every context, or not on the same prompts: no like-for-like ratio
        shortest = by_context[contexts[0]].tau
        lines.append(f"| {arm} | " + " | ".join(f"{by_context[c].tau:.2f}" for c in contexts) + " | "
                     + " | ".join(_cell(by_context[c].tau / shortest if shortest else None) for c in contexts[1:])
                     + " |")
    return lines if len(lines) > 2 else []


def markdown(
    summaries: list[ArmSummary], scores: list[CandidateScore], header: str, pairs: list[PolicyPairs] | None = None
) -> str:
    """The report: one evaluation table per dataset, then the tuning pass and its pairs of policies."""
    lines = [header, ""]
    for dataset in dict.fromkeys(s.dataset for s in summaries):
        lines += [
            f"## {dataset}", "",
            "| context | arm | tau | decode tok/s | decode speedup | e2e tok/s | e2e speedup | TTFT s "
            "| draft / verify / host ms per step | working set | peak GiB | exact / near-tie / mismatch |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for s in (s for s in summaries if s.dataset == dataset):
            lines.append(
                f"| {s.context} | {s.label} | {s.tau:.2f} | {s.decode_tokens_per_s:.1f} | {_cell(s.decode_speedup)} "
                f"| {s.end_to_end_tokens_per_s:.1f} | {_cell(s.end_to_end_speedup)} | {s.first_token_seconds:.3f} "
                f"| {s.draft_ms_per_step:.2f} / {s.verify_ms_per_step:.2f} / {s.host_ms_per_step:.2f} "
                f"| {s.working_set_tokens} | {_cell(s.peak_memory_gib)} "
                f"| {s.exact} / {s.near_ties} / {s.mismatches}{f' ({s.unchecked} unchecked)' if s.unchecked else ''} |"
            )
        lines.append("")
        by_context = tau_by_context_lines([s for s in summaries if s.dataset == dataset])
        if by_context:
            lines += [f"### {dataset}: tau against the shortest context, on the same prompts", "", *by_context, ""]
    if not scores:
        return "\n".join(lines) + "\n"
    lines += ["## Tuning pass", "",
              "First pass: every candidate. Final round (where run): the first pass's fastest again on the same "
              f"prompts with the evaluation's tokens; of those within {FINAL_TIE:.0%} of the fastest there, the one "
              "that verifies the fewest tree tokens per emitted token is chosen.", "",
              "| dataset | context | candidate | prompts | tau | decode tok/s | final tau | final decode tok/s "
              "| final tree tokens per token | chosen |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {c.dataset} | {c.context} | {c.label} | {c.prompts} | {c.tau:.2f} | {c.decode_tokens_per_s:.1f} "
              f"| {_cell(c.final_tau)} | {_cell(c.final_decode_tokens_per_s, 1)} "
              f"| {_cell(c.final_tree_tokens_per_token)} | {'**yes**' if c.chosen else ''} |"
              for c in scores]
    if pairs:
        lines += ["", "### `online` against `full` at the same start tree", "",
                  "Per context, the runs of both rounds where both policies ran at one tree, working set and prompt: "
                  f"the geometric mean of their decode speeds' ratios and its {INTERVAL:.0%} bootstrap interval over "
                  "the pairs.", "",
                  "| dataset | context | pairs | online / full | interval | verdict |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {p.dataset} | {p.context} | {p.pairs} | {p.ratio:.3f} | {p.low:.3f}-{p.high:.3f} | {p.verdict} |"
                  for p in pairs]
    return "\n".join(lines) + "\n"


def to_dicts(items: list) -> list[dict]:
    return [asdict(item) for item in items]
