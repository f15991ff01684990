"""A benchmark run's audit of the ``online`` batch bounds (``draft_service.bound_audit``), as JSON.

Why here: ``bench.batching`` and every protocol or paired run (``bench.reproduce.runs``) report, per bound
an online run proposed within, what the batch planner predicted against what its steps delivered; the
report's JSON form and how to find the in-process draft behind an engine are the same for both.
"""

from __future__ import annotations

from bench.warmup import in_process_draft
from draft_service.batch_plan import StepSeconds
from draft_service.bound_audit import AuditSnapshot, BoundAudit, BoundReport, ChoiceRecord


def engine_bound_audit(engine: object) -> BoundAudit:
    """The in-process draft's audit (``bench.warmup.in_process_draft``); an empty one without one."""
    draft = in_process_draft(engine)
    return draft.bound_audit if draft is not None else BoundAudit()


def audits_since(audit: BoundAudit, earlier: AuditSnapshot) -> dict[str, dict]:
    """Per bound proposed within since ``earlier`` ("tokens:depth", the most proposed first), ``audit_json``'s."""
    return {f"{b.tokens}:{b.depth}": audit_json(report) for b, report in audit.reports(since=earlier).items()}


def choices_json(records: list[ChoiceRecord]) -> list[dict]:
    """Each choice of the bound in order: the bound taken; per bound scored ("tokens:depth") the tokens a step
    predicted for the batch, its step's ms and the tokens/s they make; and per logged online session its E per
    candidate ("full T:t:D" for a dynamic tree, "shaped w1,w2,..." for a static one)."""
    return [
        {"bound": f"{r.bound.tokens}:{r.bound.depth}", "scored": {
            f"{b.tokens}:{b.depth}": {"tokens_per_step": round(p.tokens_per_step, 3),
                                      "step_ms": round(1000 * p.seconds.total, 3),
                                      "tokens_per_s": round(p.tokens_per_second, 1)}
            for b, p in r.choice.scored.items()},
         "expected": [{c.label: round(e, 3) for c, e in session.items()} for session in r.choice.expectations]}
        for r in records
    ]  # fmt: skip


def audit_json(report: BoundReport) -> dict:
    """One bound's audit: tokens per step per session, tokens/s of the batch, seconds in ms."""

    def ms(seconds: StepSeconds) -> dict[str, float]:
        parts = {"step": seconds.total, "overhead": seconds.overhead, "draft": seconds.draft, "verify": seconds.verify}
        return {part: round(1000 * value, 3) for part, value in parts.items()}

    realised, runner_up = report.realised_tokens_per_step, report.runner_up_tokens_per_second
    return {
        "proposals": report.proposals,
        "choices": report.choices,
        "batch": round(report.batch, 2),
        "context_tokens": round(report.context_tokens),
        "predicted_tokens_per_step": round(report.predicted_tokens_per_step, 3),
        "realised_tokens_per_step": round(realised, 3) if realised is not None else None,
        "predicted_tokens_per_s": round(report.predicted_tokens_per_second, 1),
        "runner_up_tokens_per_s": round(runner_up, 1) if runner_up is not None else None,
        "predicted_ms": ms(report.predicted_seconds),
        "measured_ms": ms(report.measured_seconds) if report.measured_seconds is not None else None,
        "measured_steps": report.measured_steps,
    }


def audit_lines(label: str, audits: dict[str, dict]) -> list[str]:
    """A line per bound of ``audits_since``'s: each prediction beside what was realised or measured."""
    lines = []
    for key, audit in audits.items():
        predicted, measured = audit["predicted_ms"], audit["measured_ms"] or {"step": None, "verify": None}
        lines.append(
            f"  {label} bound {key}: {audit['proposals']} proposals, {audit['choices']} choices; predicted /"
            f" realised tokens per step {audit['predicted_tokens_per_step']} / {audit['realised_tokens_per_step']},"
            f" step ms {predicted['step']} / {measured['step']}, verify ms {predicted['verify']} /"
            f" {measured['verify']}; predicted tokens/s {audit['predicted_tokens_per_s']}, runner-up"
            f" {audit['runner_up_tokens_per_s']}"
        )
    return lines
