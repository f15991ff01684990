"""Draft time per step against the head's weight-read floor, measured in one run.

A step of the draft is an accept (the verified tokens' entries committed: one eager head pass
over them) and a proposal (the whole tree grown on the device, replayed from one CUDA graph).
For each context length and batch, synthetic sessions (random target features, random tokens:
timing does not need real text) are started, then each step is timed with CUDA events and
host clocks, median of several:

- ``accept_ms``: committing 5 entries per session (a typical accepted path plus the bonus token);
- ``device_write_ms`` and ``settle_ms``: the same accept as an engine in one process makes it for greedy
  sessions: the entries written from the device's acceptance (host time to launch it, which the verify's
  forward hides), then settled against the host's acceptance (until the device is done too, the part left
  on the step's critical path);
- ``propose_ms``: the proposal call, wall time to trees on the host;
- ``launch_ms``: host time of the graph's launch alone (``CUDAGraph.replay`` returning);
- ``graph_gpu_ms``: the replayed graph's GPU time (CUDA events around the replay);
- ``kernels_per_proposal`` and ``proposal_costliest_kernels``: the proposal run eagerly under the torch profiler,
  its kernels counted and the costliest listed by name (launches, GPU microseconds); ``kernels_per_start`` and
  ``start_costliest_kernels`` the same of a session's start (below), where its time above its floor goes, and
  ``start_kernel_ms`` its kernels' GPU time summed: ``start_ms`` above it is time the GPU waited;
- ``accept_ops``, ``accept_device_work`` and ``accept_costliest_host_ops``: one accept under the torch
  profiler: the torch ops it dispatches, the kernels and copies it puts on the device, and the ops that
  cost the host most (calls, CPU microseconds of their own). An accept is host-bound: these say where the
  working set's share of it goes;
- ``start_ms`` and ``start_floor_ms``: a session's start, the head's pass over every prompt position (one
  session; in serving it runs in the first draft call after the first token, inside the request's decode), and
  the matmul FLOPs it needs (``start_flops``) over the bf16 matmul peak measured in the same run;
  ``start_host_ms`` the same call until it returns, not waiting for the device: near ``start_ms``, the host
  (its work, or a wait inside the call) holds the start; far under it, the launched kernels do;
  ``start_costliest_calls`` the functions (Python's, and the C ones they call) that cost one start's host most;
- ``floor_ms``: the bytes a proposal must read (the head's weights once per depth, int8 ones with
  ``--draft-quantization int8``, plus each session's attended context once per depth) over the copy
  bandwidth measured in the same run.

    python -m bench.draft_times --base-model /tmp/b8/target --draft-model /tmp/b8/head --out bench/results/draft_times_8b.json
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, get_args

import torch

from bench.kernels import copy_bandwidth, matmul_peak, median_ms
from diffspec.device_accept import DeviceAccept
from draft_service.drafter import DeviceExtension, Drafter, Extension, ProposalRequest
from draft_service.eagle3_head import Eagle3Head
from draft_service.options import DraftOptions, validate_options
from draft_service.serving_weights import Quantization
from draft_service.target_embedding import load_target_embedding
from draft_service.tree_plan import fixed_candidate
from draft_service.working_set import WorkingSetConfig

ACCEPTED_PER_STEP = 5  # entries an accept commits per session
REPEATS = 20  # host-timed runs per figure
TOP_KERNELS = 12  # kernels listed by name per point


def _host_seconds(work: Callable[[], object], sync: bool) -> float:
    """Median wall seconds of ``work`` (``sync``: until the GPU has finished it too)."""
    times = []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        started = time.perf_counter()
        work()
        if sync:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def start_flops(head: Eagle3Head, positions: int) -> float:
    """The matmul FLOPs a start over ``positions`` prompt positions needs (a one-layer head): ``fc`` (3h -> h) and
    the k and v projections of the layer's 2h-wide input per position, and the q projection of the last one
    (the root's query; the others are never read)."""
    c = head.config
    h, q_out, kv_out = c.hidden_size, c.num_heads * c.head_dim, 2 * c.num_kv_heads * c.head_dim
    return 2.0 * (positions * (3 * c.target_hidden_size * h + 2 * h * kv_out) + 2 * h * q_out)


def measure(
    head: Eagle3Head, context: int, batch: int, options: DraftOptions, bandwidth: float, peak_flops: float,
    quantization: Quantization,
) -> dict:
    """One (context, batch, options, quantization) point: the accept, the proposal and its graph, and the floor."""
    c, device = head.config, head.fc.weight.device
    drafter = Drafter(head, cuda_graphs=True, quantization=quantization)
    policy, budget = validate_options(options)
    candidate = fixed_candidate(policy, budget)
    salience = WorkingSetConfig() if options.salience else None
    torch.manual_seed(context + batch)
    width, dtype = 3 * c.target_hidden_size, head.fc.weight.dtype
    sessions = []
    for _ in range(batch):
        ids = torch.randint(c.draft_vocab_size, (context,)).tolist()
        sessions.append(drafter.start(ids, torch.randn(context, width, device=device, dtype=dtype), ids[-1], salience))
    prompt_ids, prompt_features = sessions[0].token_ids[:-1], torch.randn(context, width, device=device, dtype=dtype)

    def start() -> None:  # one more session over the same prompt, timed and profiled below
        drafter.start(prompt_ids, prompt_features, 7, salience)

    start_seconds = _host_seconds(start, sync=True)
    start_host_seconds = _host_seconds(start, sync=False)
    start_kernels = _kernel_profile(start, "start")
    start_calls = _python_profile(start, "start")
    del prompt_features, start
    requests = [ProposalRequest(s, list(candidate.plan), candidate.budget) for s in sessions]
    accept_features = torch.randn(ACCEPTED_PER_STEP, width, device=device, dtype=dtype)

    def accept() -> None:
        # each accept grows the context by a few entries: the proposal's capacity stays in one bucket
        drafter.extend_many([Extension(s, accept_features, [7] * ACCEPTED_PER_STEP) for s in sessions])

    written = DeviceAccept(
        accept_features,
        torch.full((ACCEPTED_PER_STEP,), 7, device=device),
        torch.tensor(ACCEPTED_PER_STEP, device=device),
        ACCEPTED_PER_STEP,
    )

    def write_on_device() -> None:
        drafter.extend_on_device([DeviceExtension(s, written) for s in sessions])

    def settle() -> None:
        drafter.commit_accepted([Extension(s, accept_features, [7] * ACCEPTED_PER_STEP) for s in sessions])

    for _ in range(3):  # the proposal shape is recorded as a graph the first time it comes
        drafter.propose_many(requests)
    proposer = drafter.proposer
    run = next(r for r in proposer._runs.values() if r.graph is not None)
    attended = sum(s.context.attended_tokens for s in sessions)
    head_bytes = drafter.weights.bytes_per_depth
    context_bytes = c.num_layers * attended * 2 * c.num_kv_heads * c.head_dim * head.fc.weight.element_size()
    depth = len(run.shape.widths)
    floor = depth * (head_bytes + context_bytes) / bandwidth
    return {
        "context": context,
        "batch": batch,
        "policy": options.policy,
        "tree_config": options.tree_config,
        "salience": options.salience,
        "quantization": quantization,
        "depth": depth,
        "attended_tokens_per_session": attended // batch,
        **_kernel_profile(lambda: proposer._search(run), "proposal"),
        "accept_ms": round(1e3 * _host_seconds(accept, sync=True), 3),
        **_device_accept_ms(write_on_device, settle),
        **_host_profile(accept, "accept"),
        "propose_ms": round(1e3 * _host_seconds(lambda: drafter.propose_many(requests), sync=True), 3),
        "launch_ms": round(1e3 * _host_seconds(run.graph.replay, sync=False), 3),
        "graph_gpu_ms": round(median_ms(run.graph.replay), 3),
        "floor_ms": round(1e3 * floor, 3),
        "start_ms": round(1e3 * start_seconds, 3),
        "start_host_ms": round(1e3 * start_host_seconds, 3),
        "start_floor_ms": round(1e3 * start_flops(head, context) / peak_flops, 3),
        **start_kernels,
        **start_calls,
    }


def _device_accept_ms(write_on_device: Callable[[], None], settle: Callable[[], None]) -> dict:
    """Median host ms of writing an accept's entries on the device (launches only) and of settling them (until
    the device has done that too), each write followed by its settle as the engine makes them; the write's own
    device work is waited for between the two, as a verify's forward would have covered it."""
    writes, settles = [], []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        started = time.perf_counter()
        write_on_device()
        writes.append(time.perf_counter() - started)
        torch.cuda.synchronize()
        started = time.perf_counter()
        settle()
        torch.cuda.synchronize()
        settles.append(time.perf_counter() - started)
    return {
        "device_write_ms": round(1e3 * statistics.median(writes), 3),
        "settle_ms": round(1e3 * statistics.median(settles), 3),
    }


@torch.no_grad()  # as the graph was recorded: with autograd on, the head would take the reference ops
def _kernel_profile(work: Callable[[], object], name: str) -> dict:
    """GPU kernels ``work`` launches when run eagerly (for a proposal, the nodes of its graph, each a launch gap),
    and the costliest by kernel name: ``kernels_per_<name>``, ``<name>_kernel_ms`` (every kernel's GPU time,
    summed) and ``<name>_costliest_kernels``, [kernel, launches, GPU us] per row."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        work()
        torch.cuda.synchronize()
    by_name: dict[str, list] = {}
    for event in profile.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = by_name.setdefault(event.name[:100], [event.name[:100], 0, 0.0])
            entry[1] += 1
            entry[2] += event.device_time
    costliest = sorted(by_name.values(), key=lambda entry: -entry[2])[:TOP_KERNELS]
    return {
        f"kernels_per_{name}": sum(entry[1] for entry in by_name.values()),
        f"{name}_kernel_ms": round(sum(entry[2] for entry in by_name.values()) / 1e3, 3),
        f"{name}_costliest_kernels": [[kernel, count, round(us, 1)] for kernel, count, us in costliest],
    }


@torch.no_grad()
def _host_profile(work: Callable[[], object], name: str) -> dict:
    """What one run of ``work`` costs the host, op by op: the torch ops it calls (not the ops those call in
    turn), the kernels and copies it puts on the device, and the ops costliest in host time, each with what
    it called inside: [op, calls, CPU us] per row."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        work()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    events = profile.events()
    on_device = sum(1 for event in events if event.device_type == torch.autograd.DeviceType.CUDA)
    by_op: dict[str, list] = {}
    for event in events:
        parent = event.cpu_parent
        if event.name.startswith("aten::") and (parent is None or not parent.name.startswith("aten::")):
            entry = by_op.setdefault(event.name, [event.name, 0, 0.0])
            entry[1] += 1
            entry[2] += event.cpu_time_total
    costliest = sorted(by_op.values(), key=lambda entry: -entry[2])[:TOP_KERNELS]
    return {
        f"{name}_ops": sum(entry[1] for entry in by_op.values()),
        f"{name}_device_work": on_device,
        f"{name}_costliest_host_ops": [[op, calls, round(us, 1)] for op, calls, us in costliest],
    }


def _python_profile(work: Callable[[], object], name: str) -> dict:
    """What one run of ``work`` costs the host function by function (Python's and the C functions it calls,
    torch's among them, each by its own time): ``<name>_costliest_calls``, [function, calls, own ms] per row.
    Where the torch profiler sees only ops, this also sees the Python between them (list building, loops)."""
    profiler = cProfile.Profile()
    profiler.runcall(work)
    rows, stats = [], pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    for (file, line, function), (_, calls, own, *_) in stats.items():
        if "_lsprof" not in function:  # the profiler's own switch-off
            where = function if file == "~" else f"{Path(file).name}:{line}({function})"
            rows.append([where, calls, round(1e3 * own, 3)])
    return {f"{name}_costliest_calls": sorted(rows, key=lambda row: -row[2])[:TOP_KERNELS]}


def plot(rows: list[dict], path: Path) -> None:
    """Per batch: accept + proposal ms against context, salience off and on, with the floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        quantizations = sorted({r["quantization"] for r in rows})
        for (salience, style), quantization in itertools.product(((False, "o-"), (True, "s--")), quantizations):
            mine = [r for r in rows if (r["batch"], r["salience"], r["quantization"]) == (batch, salience, quantization)]
            contexts = [r["context"] for r in mine]
            label = ("salience" if salience else "full context") + (f", {quantization}" if len(quantizations) > 1 else "")
            ax.plot(contexts, [r["accept_ms"] + r["propose_ms"] for r in mine], style, label=f"accept + propose, {label}")
            ax.plot(contexts, [r["floor_ms"] for r in mine], style, alpha=0.4, label=f"weight + context read floor, {label}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_ylabel("ms per draft step")
        ax.set_title(f"{batch} session(s), {rows[0]['tree_config']}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def head_parser(description: str) -> argparse.ArgumentParser:
    """The flags of a benchmark of the head on the GPU: its target (for the embedding), its directory, the output."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-model", type=Path, required=True, help="the target (its embedding feeds the head)")
    parser.add_argument("--draft-model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    return parser


def parse_with_gpu_head(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, Eagle3Head]:
    """The flags, and the head on the GPU (exit status 2 without one)."""
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog} needs a GPU\n")
    return args, load_gpu_head(args.base_model, args.draft_model)


def main() -> int:
    parser = head_parser(__doc__)
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 16384, 65536])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--tree-config", default="64:0.0:8")
    parser.add_argument("--draft-quantization", nargs="+", default=["none"], choices=get_args(Quantization),
                        help="the head's per-depth matmuls; each value measures every point")
    args, head = parse_with_gpu_head(parser)
    bandwidth, peak_flops = copy_bandwidth(), matmul_peak()
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            for salience in (False, True):
                for quantization in args.draft_quantization:
                    options = DraftOptions("full", args.tree_config, salience=salience)
                    row = measure(head, context, batch, options, bandwidth, peak_flops, quantization)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    write_rows(rows, bandwidth, args.out, plot)
    return 0


def load_gpu_head(base_model: Path, draft_model: Path) -> Eagle3Head:
    """The head in bf16 on the GPU, over its target's embedding, for timing."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    head = Eagle3Head.load(draft_model, load_target_embedding(base_model, device, dtype), device, dtype)
    return head.eval()


def write_rows(rows: list[dict], bandwidth: float, out: Path, plot_rows: Callable[[list[dict], Path], None]) -> None:
    """The JSON (device, the copy bandwidth of the run, its rows) and its plot beside it."""
    summary = {"device": torch.cuda.get_device_name(), "copy_bandwidth_gb_s": round(bandwidth / 1e9), "rows": rows}
    out.write_text(json.dumps(summary, indent=1))
    plot_rows(rows, out.with_suffix(".png"))


if __name__ == "__main__":
    sys.exit(main())
