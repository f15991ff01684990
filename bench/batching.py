"""Aggregate tokens/s against concurrent streams, Auto and DiffSpec, through the one engine loop.

Every stream sends ``--requests-per-stream`` full generations in turn (prefill, then Auto decode
or speculative steps); the engine loop verifies all decoding streams in one target call per
iteration. Each (mode, streams) runs
once untimed first, so no CUDA graph is recorded inside a timed run. Reported per (mode,
streams): generated tokens over wall time, each stream's decode tokens/s (prompts left out) and tau,
requests verified per iteration and the rows their
verify computed (requests x widest tree), the target calls with and without prompt work (with the
slowest prompt call and the prompt tokens per call), the loop's own host time per iteration (wall time
outside the draft and target calls), and what a timed run should not do: record proposal graphs or
compile Triton kernels. Online modes add the batch bounds proposed within and, per bound, what the
batch planner predicted for it against what its steps delivered (``draft_service.bound_audit``), and
every row the prices the planners read for a proposal by depth. A plot of throughput against streams goes
beside the JSON. ``--temperature`` makes every request sample (seed 0), so a sampled batch's step is measured
against the greedy one's.

    python -m bench.batching --base-model .carry/b8/target --draft-model .carry/b8/head \
        --data .carry/data/shortctx_eval.jsonl --streams 1 4 16 32 --out bench/results/batching.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.bound_audits import audit_lines, audits_since, engine_bound_audit
from bench.warmup import in_process_draft, triton_kernels_compiled, warm_up_draft, warm_up_target
from diffspec.heap import startup_heap_frozen
from diffspec.sampling_params import SamplingParams
from diffspec.settings import DiffSpecSettings
from draft_service.options import DraftOptions
from draft_service.tree_plan import CANDIDATE_GRID
from gateway.assembly import build_engine
from gateway.engine import SpeculativeEngine
from gateway.request import GenerationRequest, GenerationStats

MODES: dict[str, DraftOptions | None] = {
    "auto": None,
    "diffspec": DraftOptions("online", "64:0.0:8", salience=True),  # budgets from the hazard profile and the batch
    "online": DraftOptions("online", "64:0.0:8"),  # the same policy over the whole context (no working set)
    "full-64": DraftOptions("full", "64:0.0:8"),  # the reproduction protocol's EAGLE-3 baseline tree
    "salience-64": DraftOptions("full", "64:0.0:8", salience=True),  # that tree over the working set (eagle3+salience)
    "full-32": DraftOptions("full", "32:0.0:6"),  # a fixed EAGLE-2 tree, for reference
    "salience-32": DraftOptions("full", "32:0.0:6", salience=True),  # that tree over the working set: 64K's choice
    "full-16": DraftOptions("full", "16:0.0:4"),
    "salience-16": DraftOptions("full", "16:0.0:4", salience=True),  # the small tree over the working set
    "chain-4": DraftOptions("chain", "5:0.0:4"),
}


@dataclass(frozen=True)
class RequestSpec:
    """What every request of a measurement asks for; only the prompt differs."""

    draft: DraftOptions | None  # None: Auto
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    # the prefix caches' scope: one per measurement, so no measurement starts from prompts another one cached
    client: str = ""

    def of(self, prompt_ids: list[int]) -> GenerationRequest:
        return GenerationRequest(
            prompt_ids, self.max_new_tokens, sampling=self.sampling, draft=self.draft, client=self.client
        )


async def one_stream(engine: SpeculativeEngine, ids: list[int], spec: RequestSpec) -> GenerationStats:
    """One request through the engine; its stats (the last chunk's)."""
    async for chunk in engine.generate(spec.of(ids)):
        if chunk.stats is not None:
            return chunk.stats
    raise RuntimeError("the engine's stream ended without its stats")


async def one_client(engine: SpeculativeEngine, prompts: list[list[int]], spec: RequestSpec) -> list[GenerationStats]:
    """One stream's requests, one after another (the next starts when the last one ends)."""
    return [await one_stream(engine, ids, spec) for ids in prompts]


async def concurrent(
    engine: SpeculativeEngine, streams: list[list[list[int]]], spec: RequestSpec
) -> tuple[list[GenerationStats], float]:
    """``streams[s]``: the prompts stream s sends in turn; all streams run at once. Every request's stats, and
    the wall seconds of the whole."""
    started = time.perf_counter()
    per_stream = await asyncio.gather(*(one_client(engine, prompts, spec) for prompts in streams))
    return [stats for stream in per_stream for stats in stream], time.perf_counter() - started


def measure(
    engine: SpeculativeEngine, mode: str, streams: list[list[list[int]]], max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
) -> dict:  # fmt: skip
    timing, audit = engine.core.timing, engine_bound_audit(engine)
    _settle(engine)  # the last run's releases: an iteration in flight would add to the reset timing
    timing.reset()
    recorded_before, audit_before, compiled_before = _draft_graphs(engine), audit.snapshot(), triton_kernels_compiled()
    spec = RequestSpec(MODES[mode], max_new_tokens, sampling, client=f"measure-{uuid.uuid4().hex}")
    requests, seconds = asyncio.run(concurrent(engine, streams, spec))
    tokens = sum(stats.new_tokens for stats in requests)
    steps = sum(stats.steps for stats in requests)
    decode_seconds = sum(stats.decode_seconds for stats in requests)
    _settle(engine)  # this run's last verify: the audit measures it
    bounds = audits_since(audit, audit_before)
    return {
        "draft_graphs_recorded_in_run": _draft_graphs(engine) - recorded_before,
        "triton_compiles_in_run": triton_kernels_compiled() - compiled_before,
        # the online batch bounds proposed within, "tokens:depth" -> proposals, commonest first
        "online_bounds": {key: report["proposals"] for key, report in bounds.items()},
        # per bound: what the batch planner predicted against what its steps delivered
        "online_bound_audit": bounds,
        # what the planners price a proposal of each depth at for this many sessions, and the points it is fitted to
        "draft_cost_ms": _draft_cost_ms(engine, len(streams)),
        "mode": mode,
        "streams": len(streams),
        "requests_per_stream": len(streams[0]),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        # without the prompts: each request's tokens after its first over its decode seconds, pooled (a stream's
        # decode speed; at one stream, the protocol's decode-only tokens/s), and tokens per target step
        "decode_tokens_per_s_per_stream": round((tokens - len(requests)) / decode_seconds, 1) if decode_seconds else 0.0,
        "tau": round((sum(stats.accepted_drafts for stats in requests) + steps) / steps, 3) if steps else 0.0,
        "mean_requests_per_verify": round(statistics.mean(timing.batch_sizes), 2) if timing.batch_sizes else 0.0,
        "mean_rows_per_verify": round(statistics.mean(timing.padded_rows), 1) if timing.padded_rows else 0.0,
        "prompt_iterations": timing.prompt_iterations,
        "prompt_ms": round(timing.prompt_ms, 3),
        "slowest_prompt_ms": round(1000 * timing.slowest_prompt_seconds, 3),
        "prompt_tokens_per_iteration": round(timing.prompt_tokens / timing.prompt_iterations) if timing.prompt_iterations else 0,
        "host_ms_per_iteration": round(timing.host_ms_per_iteration, 3),
        "draft_ms_per_iteration": round(timing.ms_per_iteration(timing.draft_seconds), 3),
        "target_ms_per_iteration": round(timing.ms_per_iteration(timing.target_seconds), 3),
        "verify_ms": round(timing.verify_ms, 3),
        "ms_per_iteration": round(timing.ms_per_iteration(timing.loop_seconds), 3),
    }


def _settle(engine: SpeculativeEngine) -> None:
    """Until the engine's loop has nothing left to run."""
    while engine.core.has_work():
        time.sleep(0.001)


def _draft_cost_ms(engine: SpeculativeEngine, batch: int) -> dict[str, dict[int, float]]:
    """The in-process draft's proposal cost model at ``batch`` sessions: its prices by depth, and the running
    averages by depth measured at each (batch, attended context) bucket (each a bit length); empty without one."""
    draft = in_process_draft(engine)
    if draft is None:
        return {}
    cost, deepest = draft.step_cost, max(budget.depth for budget in CANDIDATE_GRID)
    priced = {depth: round(1000 * cost.draft_seconds(depth, batch), 3) for depth in range(1, deepest + 1)}
    measured = {
        f"bucket {batch_bucket}, attended {attended}": {
            depth: round(1000 * seconds, 3) for depth, seconds in sorted(points.items())}
        for (batch_bucket, attended), points in sorted(cost.draft_seconds_by_shape.items())
    }
    return {"priced": priced, **measured}


def _draft_graphs(engine: SpeculativeEngine) -> int:
    """Proposal graphs the in-process draft has recorded (0 without one): a capture inside a timed run costs
    tens of milliseconds, so a run that records many is not steady state."""
    draft = in_process_draft(engine)
    return draft.drafter.proposer.num_recorded if draft is not None else 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        ax.plot([r["streams"] for r in mine], [r["tokens_per_s"] for r in mine], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate tokens/s")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-model", type=Path, required=True)
    parser.add_argument("--draft-model", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--modes", nargs="+", default=["auto", "diffspec", "full-32"], choices=list(MODES))
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--requests-per-stream", type=int, default=1,
        help="requests each stream sends in turn: 1 is one closed batch; more keeps every stream busy, so the "
        "batch's staggered start and its uneven finish weigh less (as a server at a fixed concurrency)",
    )  # fmt: skip
    parser.add_argument("--num-pages", type=int, default=8192)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="every request samples at this temperature with seed 0 (0: greedy)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    sampling = SamplingParams(temperature=args.temperature, seed=0)
    batch_sizes = ",".join(str(b) for b in sorted({1, 2, 4, 8, 16, *args.streams}))
    settings = DiffSpecSettings(
        base_model=args.base_model, draft_model=args.draft_model, num_pages=args.num_pages,
        graph_batch_sizes=batch_sizes, max_sessions=max(64, max(args.streams)),
    )  # fmt: skip
    engine = build_engine(settings)
    texts = [json.loads(line)["text"] for line in args.data.read_text().splitlines()]
    encoded = [engine.tokenizer(t)["input_ids"] for t in texts[: max(args.streams)]]
    cuts = 0

    def prompts(streams: int) -> list[list[list[int]]]:
        """Stream s sends text s, each request cut one token earlier than any before it: no request
        reuses another's prefix pages."""
        nonlocal cuts
        per_stream = []
        for ids in encoded[:streams]:
            per_stream.append([])
            for cut in range(cuts + 1, cuts + 1 + args.requests_per_stream):
                per_stream[-1].append(ids[len(ids) - args.prompt_tokens - cut : len(ids) - cut])
        cuts += args.requests_per_stream
        return per_stream

    print(f"recorded {warm_up_target(engine)} step graphs, proposed {warm_up_draft(engine)} warm-up trees", flush=True)
    rows = []
    with startup_heap_frozen():  # as a server's heap is once it is up (diffspec/heap.py)
        for mode in args.modes:
            for streams in args.streams:
                # untimed first: every draft graph shape this run meets is recorded, and the planner has its costs
                measure(engine, mode, prompts(streams), args.max_new_tokens, sampling)
                rows.append(measure(engine, mode, prompts(streams), args.max_new_tokens, sampling))
                label = f"{rows[-1]['mode']} x{rows[-1]['streams']}"
                print(json.dumps(rows[-1]), *audit_lines(label, rows[-1]["online_bound_audit"]), sep="\n",
                      flush=True)
    for row in rows:
        single = next(r for r in rows if r["mode"] == row["mode"] and r["streams"] == min(args.streams))
        auto = next((r for r in rows if r["mode"] == "auto" and r["streams"] == row["streams"]), None)
        row["vs_one_stream"] = round(row["tokens_per_s"] / single["tokens_per_s"], 2)
        row["vs_auto"] = round(row["tokens_per_s"] / auto["tokens_per_s"], 2) if auto else None
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "device": device, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(rows, args.out.with_suffix(".png"))
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
