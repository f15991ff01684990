"""Nsight Compute on one Auto step and one DiffSpec step: L2 hit rate, HBM and L1TEX traffic and
achieved occupancy per kernel.

The command re-runs itself under ``ncu`` as a driver that loads the engine on the given models and
steps its loop by hand (``EngineCore.step`` in this thread, as ``bench/profile_generation.py`` does),
so the CUDA profiler can be switched on for exactly the iterations wanted, each inside an NVTX range:

- ``auto step``: one Auto decode iteration (the target's step graph);
- ``diffspec start``: the iteration in which the draft session starts: the draft's KV over the
  prompt, the working set chosen and the chunk arena filled by gathering every selected chunk
  (``ChunkArena.apply``, through ``draft_context.reselect_all``), then the first proposal and its verification;
- ``diffspec step``: one steady DiffSpec iteration (accept, arena refresh, proposal, tree verify);
  the draft attends to the arena staged with the partial tail chunk (``DraftContext.view``'s gather).

Each mode first runs once unprofiled (Triton compiles and CUDA-graph captures stay out of the
profile). ``torch.autograd.profiler.emit_nvtx`` names the aten op (and the engine's
``record_function`` phases) around every kernel launch, so each kernel row says which op launched it.

    python -m bench.collect_ncu --base-model .carry/b8/target --draft-model .carry/b8/head \
        --data .carry/data/shortctx_eval.jsonl --out-dir bench/results/ncu_b8

writes ``ncu_steps.ncu-rep`` (open it in the Nsight Compute GUI), ``ncu_raw.csv`` (``ncu --import
... --csv --page raw``), ``ncu_kernels.json`` and ``ncu_kernels.md``. ``ncu`` must be on PATH (or
``--ncu``); ``--clock-control none`` keeps the GPU's own clocks, as in the timed runs.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

STEP_RANGES = ("auto step", "diffspec start", "diffspec step")
MAX_NEW_TOKENS = 1024  # more than the profiled iterations can emit; the request is aborted after them
L2_HIT_RATE = "lts__t_sector_hit_rate.pct"  # % of L2 sector lookups that hit
L2_SECTORS = "lts__t_sectors.sum"  # L2 sector lookups (weights the hit rate over launches)
DRAM_READ = "dram__bytes_read.sum"  # HBM bytes read
DRAM_WRITE = "dram__bytes_write.sum"  # HBM bytes written
L1TEX_BYTES = "l1tex__t_bytes.sum"  # bytes through the L1/texture cache
OCCUPANCY = "sm__warps_active.avg.pct_of_peak_sustained_active"  # achieved occupancy, %
DURATION = "gpu__time_duration.sum"  # kernel time
METRICS = (DURATION, L2_HIT_RATE, L2_SECTORS, DRAM_READ, DRAM_WRITE, L1TEX_BYTES, OCCUPANCY)
NVTX_COLUMN_MARK = "Push/Pop_Range"  # the raw page's NVTX column: "thread Domain:Push/Pop_Range:..."
UNIT_SCALE = {
    "": 1.0, "%": 1.0, "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12,
    "sector": 1.0, "Ksector": 1e3, "Msector": 1e6, "Gsector": 1e9,
    "nsecond": 1.0, "usecond": 1e3, "msecond": 1e6, "second": 1e9, "ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9,
}  # to bytes, sectors or nanoseconds (ncu writes durations as "us" in raw CSV, "usecond" in its details page)


@dataclass(frozen=True)
class KernelLaunch:
    """One profiled kernel launch (a row of the raw page)."""

    id: int
    name: str  # as ncu prints it (demangled)
    step: str | None  # the STEP_RANGES entry it ran in (None: outside them)
    op: str  # innermost NVTX range below the step (the aten op or engine phase), "" when none
    metrics: dict[str, float | None]  # METRICS name -> value in base units (None: ncu had none)


@dataclass
class KernelSummary:
    """Every launch of one kernel name under one op within one step."""

    step: str
    op: str
    name: str
    launches: int = 0
    duration_ns: float = 0.0
    dram_read_bytes: float = 0.0
    dram_write_bytes: float = 0.0
    l1tex_bytes: float = 0.0
    l2_sectors: float = 0.0
    l2_rated_sectors: float = 0.0  # sectors of the launches whose hit rate is a rate (0-100%)
    l2_hit_sectors: float = 0.0  # those sectors x hit rate, summed (the hit rate below is their ratio)
    l2_out_of_range: int = 0  # launches whose hit rate fell outside 0-100%, left out of it
    occupancy_ns: float = 0.0  # achieved occupancy x duration, summed
    unmeasured: list[str] = field(default_factory=list)  # metrics some launch lacked

    @property
    def l2_hit_rate(self) -> float | None:
        """% of L2 sectors that hit, over the launches with an in-range rate.

        ncu counts hits and lookups in different replays; on a kernel too small to reach a steady state the
        two disagree and the "rate" leaves 0-100% (Nsight Compute's own guidance: such a value was not
        collected accurately), so it is not averaged in."""
        return 100 * self.l2_hit_sectors / self.l2_rated_sectors if self.l2_rated_sectors else None

    @property
    def achieved_occupancy(self) -> float | None:
        """% of the peak warps active, weighted by each launch's duration."""
        return self.occupancy_ns / self.duration_ns if self.duration_ns else None

    def add(self, launch: KernelLaunch) -> None:
        m = launch.metrics
        self.launches += 1
        for name in METRICS:
            if m.get(name) is None and name not in self.unmeasured:
                self.unmeasured.append(name)
        duration, sectors = m.get(DURATION) or 0.0, m.get(L2_SECTORS) or 0.0
        self.duration_ns += duration
        self.dram_read_bytes += m.get(DRAM_READ) or 0.0
        self.dram_write_bytes += m.get(DRAM_WRITE) or 0.0
        self.l1tex_bytes += m.get(L1TEX_BYTES) or 0.0
        self.l2_sectors += sectors
        hit_rate = m.get(L2_HIT_RATE)
        if hit_rate is not None and 0.0 <= hit_rate <= 100.0:
            self.l2_rated_sectors += sectors
            self.l2_hit_sectors += sectors * hit_rate / 100
        elif hit_rate is not None:
            self.l2_out_of_range += 1
        self.occupancy_ns += duration * (m.get(OCCUPANCY) or 0.0)

    def to_dict(self) -> dict:
        return {**asdict(self), "l2_hit_rate": self.l2_hit_rate, "achieved_occupancy": self.achieved_occupancy}


# -- the raw page ------------------------------------------------------------------------------


def parse_number(text: str) -> float | None:
    """A raw-page cell: "1,234.5" -> 1234.5; "", "n/a" and other non-numbers -> None."""
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def nvtx_ranges(cell: str) -> list[str]:
    """Range names of a raw-page NVTX cell, outermost first.

    The cell is the thread id then one quoted entry per open range,
    ``"<domain>:<range>:<PL_Type>:<PL_Value>:<CLR_Type>:<Color>:<Msg_Type>:<Msg>"``; a range name may
    itself hold colons (``aten::cat``), so the six trailing fields are split off from the right.
    """
    names = []
    for entry in cell.split('"')[1::2]:
        _, _, rest = entry.partition(">:") if entry.startswith("<") else entry.partition(":")
        name = rest.rsplit(":", 6)[0] if rest.count(":") >= 6 else rest
        names.append(name.split(",")[0].strip())  # emit_nvtx appends ", seq = N, sizes = [...]"
    return names


def parse_raw_csv(text: str) -> list[KernelLaunch]:
    """``ncu --csv --page raw`` output: a header row, a units row, then one row per kernel launch.
    Lines before the header (``==PROF==`` messages, the program's own output) are skipped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no ncu raw-page header (a line starting with \"ID\") in the CSV")
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, units = rows[0], rows[1]
    column = {name: i for i, name in enumerate(header)}
    missing = [name for name in ("ID", "Kernel Name") if name not in column]
    if missing:
        raise ValueError(f"ncu raw page without columns {missing}")
    nvtx = next((i for i, name in enumerate(header) if NVTX_COLUMN_MARK in name), None)
    launches = []
    for row in rows[2:]:
        if len(row) != len(header) or parse_number(row[column["ID"]]) is None:
            continue
        ranges = nvtx_ranges(row[nvtx]) if nvtx is not None else []
        step = next((r for r in ranges if r in STEP_RANGES), None)
        below = ranges[ranges.index(step) + 1:] if step is not None else ranges
        metrics = {}
        for name in METRICS:
            value = parse_number(row[column[name]]) if name in column else None
            scale = UNIT_SCALE.get(units[column[name]].strip(), 1.0) if name in column else 1.0
            metrics[name] = None if value is None else value * scale
        launches.append(KernelLaunch(int(parse_number(row[column["ID"]]) or 0), row[column["Kernel Name"]], step,
                                     below[-1] if below else "", metrics))
    return launches


def summarise(launches: list[KernelLaunch]) -> list[KernelSummary]:
    """One summary per (step, op, kernel), steps in STEP_RANGES order, the longest kernels first."""
    summaries: dict[tuple[str, str, str], KernelSummary] = {}
    for launch in launches:
        if launch.step is None:
            continue
        key = (launch.step, launch.op, launch.name)
        summaries.setdefault(key, KernelSummary(*key)).add(launch)
    return sorted(summaries.values(), key=lambda s: (STEP_RANGES.index(s.step), -s.duration_ns))


def short_name(name: str, width: int = 60) -> str:
    """``void at::native::(anonymous namespace)::f<4, ...>(...)`` -> ``at::native::f`` (ncu may write the
    anonymous namespace as ``<unnamed>``), cut to ``width``."""
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "").replace("<unnamed>::", "")
    name = name[: min((i for i in (name.find("<"), name.find("(")) if i > 0), default=len(name))]
    return name if len(name) <= width else name[: width - 1] + "…"


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def markdown(summaries: list[KernelSummary], header: str) -> str:
    lines = [header, ""]
    for step in STEP_RANGES:
        mine = [s for s in summaries if s.step == step]
        if not mine:
            continue
        total_ns = sum(s.duration_ns for s in mine)
        hbm = sum(s.dram_read_bytes + s.dram_write_bytes for s in mine)
        lines += [
            f"## {step}: {len(mine)} kernels, {sum(s.launches for s in mine)} launches, {total_ns / 1e3:.1f} us of "
            f"kernel time, {hbm / 1e6:.2f} MB of HBM traffic", "",
            "| kernel | op | launches | us | L2 hit % | HBM read MB | HBM write MB | L1TEX MB | achieved occupancy % |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        lines += [f"| `{short_name(s.name)}` | {s.op or '-'} | {s.launches} | {s.duration_ns / 1e3:.1f} "
                  f"| {_cell(s.l2_hit_rate, '.1f')} | {s.dram_read_bytes / 1e6:.3f} | {s.dram_write_bytes / 1e6:.3f} "
                  f"| {s.l1tex_bytes / 1e6:.3f} | {_cell(s.achieved_occupancy, '.1f')} |" for s in mine]
        lines.append("")
    return "\n".join(lines)


# -- the profiled run --------------------------------------------------------------------------


def ncu_commands(ncu: str, out_dir: Path, driver_args: list[str]) -> tuple[list[str], list[str]]:
    """(profile, export): ncu around the driver writing the report, then the report as raw-page CSV."""
    report = out_dir / "ncu_steps"
    profile = [
        ncu, "--clock-control", "none", "--profile-from-start", "off", "--nvtx", "--target-processes", "all",
        "--metrics", ",".join(METRICS), "--export", str(report), "--force-overwrite",
        sys.executable, "-m", "bench.collect_ncu", "--driver", *driver_args,
    ]
    export = [ncu, "--import", f"{report}.ncu-rep", "--csv", "--page", "raw"]
    return profile, export


def driver_argv(args: argparse.Namespace) -> list[str]:
    """The flags the profiled driver process gets: the same run, without --ncu."""
    return ["--base-model", str(args.base_model), "--draft-model", str(args.draft_model), "--data", str(args.data),
            "--context", str(args.context), "--policy", args.policy, "--tree-config", args.tree_config,
            "--warm-steps", str(args.warm_steps), "--out-dir", str(args.out_dir), "--steps", *args.steps]


def collect(args: argparse.Namespace) -> int:
    """Profile the driver under ncu, export the raw page, and write the tables (``--report-only``: only the
    tables, from an earlier run's ``ncu_raw.csv`` and ``ncu_driver.json`` in ``--out-dir``)."""
    if args.report_only:
        earlier = args.out_dir / "ncu_kernels.json"
        command = json.loads(earlier.read_text())["command"] if earlier.exists() else []
        return write_report(args, command)
    ncu = args.ncu or shutil.which("ncu")
    if ncu is None:
        print("collect_ncu: no `ncu` on PATH (Nsight Compute ships with the CUDA toolkit); pass --ncu", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    profile, export = ncu_commands(ncu, args.out_dir, driver_argv(args))
    print("running:", " ".join(profile), flush=True)
    if subprocess.run(profile, check=False).returncode != 0:
        print("collect_ncu: the profiled driver failed", file=sys.stderr)
        return 1
    raw = subprocess.run(export, check=True, capture_output=True, text=True).stdout
    (args.out_dir / "ncu_raw.csv").write_text(raw)
    return write_report(args, profile)


def write_report(args: argparse.Namespace, profile: list[str]) -> int:
    """``ncu_kernels.json`` and ``ncu_kernels.md`` from ``ncu_raw.csv`` and the driver's ``ncu_driver.json``."""
    summaries = summarise(parse_raw_csv((args.out_dir / "ncu_raw.csv").read_text()))
    if not summaries:
        print(f"collect_ncu: no profiled kernel ran inside the ranges {list(STEP_RANGES)} (see "
              f"{args.out_dir / 'ncu_raw.csv'}: its NVTX column)", file=sys.stderr)
        return 1
    driver = json.loads((args.out_dir / "ncu_driver.json").read_text())
    missed = [name for name in args.steps if name not in driver["profiled"]]
    if missed:
        print(f"collect_ncu: the generation ended before {missed}; lower --warm-steps", file=sys.stderr)
    out_of_range = sum(s.l2_out_of_range for s in summaries)
    header = (f"# Nsight Compute: one Auto step and one DiffSpec step\n\n`{' '.join(profile)}`\n\n"
              f"target `{args.base_model}`, head `{args.draft_model}`, {driver['prompt_tokens']} prompt tokens, "
              f"DiffSpec {args.policy} {args.tree_config} over the salience working set; {driver['device']}. "
              "L2 hit %: sector hits over lookups, weighted by lookups, leaving out the "
              f"{out_of_range} launches whose rate fell outside 0-100% (kernels too small for ncu's replays to "
              "agree); HBM: DRAM bytes; L1TEX: bytes through L1/texture; "
              "achieved occupancy: active warps over the peak, weighted by kernel time. "
              "The chunk arena's gather: `diffspec start` fills the arena (copies under the draft's start), "
              "`diffspec step` stages it for attention (`aten::cat` under the proposal and accept).")
    (args.out_dir / "ncu_kernels.json").write_text(json.dumps(
        {"command": profile, "driver": driver, "metrics": list(METRICS),
         "kernels": [s.to_dict() for s in summaries]}, indent=1))
    table = markdown(summaries, header)
    (args.out_dir / "ncu_kernels.md").write_text(table)
    print(table)
    return 0


class _Collected:
    """An ``OutputSink`` filled synchronously by the engine loop stepped in this thread."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.done = False
        self.error: BaseException | None = None

    def put(self, chunk) -> None:  # noqa: ANN001 - a GenerationChunk
        self.tokens += chunk.token_ids
        self.done = self.done or chunk.stats is not None

    def fail(self, error: BaseException) -> None:
        self.error, self.done = error, True


def drive(args: argparse.Namespace) -> int:
    """Under ncu: load the engine, then per mode one unprofiled generation and one with the profiled iterations."""
    import uuid

    import torch

    from bench.reproduce.prompts import cut_to_context, read_texts
    from bench.warmup import warm_up_target
    from diffspec.settings import DiffSpecSettings
    from draft_service.options import DraftOptions
    from gateway.assembly import build_engine
    from gateway.request import GenerationRequest

    settings = DiffSpecSettings(base_model=args.base_model, draft_model=args.draft_model)
    pages = 2 * -(-(args.context + MAX_NEW_TOKENS) // settings.page_size) + 64  # two sequences, generation included
    settings = settings.model_copy(update={"num_pages": max(settings.num_pages, pages)})
    engine = build_engine(settings)
    warm_up_target(engine)
    core = engine.core
    core.detach_loop()  # this thread runs the loop's iterations
    texts = read_texts(args.data)
    ids = max((engine.tokenizer(t)["input_ids"] for t in texts[:64]), key=len)
    prompt = cut_to_context(ids, args.context)

    def run(options: DraftOptions | None, profiled: dict[int, str]) -> None:
        """Generate, wrapping the decode iterations numbered in ``profiled`` (0 = the first after prefill);
        the request is aborted after the last of them (or after ``warm_steps`` + 1 when none)."""
        sink = _Collected()
        request_id = uuid.uuid4().hex
        core.submit(request_id, GenerationRequest(prompt, MAX_NEW_TOKENS, draft=options), sink)
        last = max(profiled, default=args.warm_steps)
        decode_iteration = -1
        while core.has_work():
            if decode_iteration == last + 1:
                core.abort(request_id)
            name = profiled.get(decode_iteration) if sink.tokens and not sink.done else None
            with _profiled(name, cuda):
                core.step()
            if name is not None:
                reached.append(name)
            if sink.tokens:
                decode_iteration += 1
        if sink.error is not None:
            raise sink.error

    cuda = torch.cuda.is_available()
    reached: list[str] = []

    diffspec = DraftOptions(args.policy, args.tree_config, salience=True)
    for options, profiled in ((None, {args.warm_steps: "auto step"}),
                              (diffspec, {0: "diffspec start", args.warm_steps: "diffspec step"})):
        profiled = {iteration: name for iteration, name in profiled.items() if name in args.steps}
        if not profiled:
            continue
        run(options, {})  # compiles and graph captures, unprofiled
        run(options, profiled)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "ncu_driver.json").write_text(json.dumps({
        "prompt_tokens": len(prompt), "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__, "warm_steps": args.warm_steps, "profiled": reached,
    }))
    return 0


@contextlib.contextmanager
def _profiled(name: str | None, cuda: bool) -> Iterator[None]:
    """The CUDA profiler on, inside an NVTX range ``name`` with one range per aten op, around the block;
    nothing when ``name`` is None or no GPU is present (the driver then only walks its iterations)."""
    import torch

    if name is None or not cuda:
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push(name)
    torch.cuda.profiler.start()
    try:
        with torch.autograd.profiler.emit_nvtx():
            yield
        torch.cuda.synchronize()
    finally:
        torch.cuda.profiler.stop()
        torch.cuda.nvtx.range_pop()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.collect_ncu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-model", type=Path, required=True, help="target checkpoint directory")
    p.add_argument("--draft-model", type=Path, required=True, help="EAGLE-3 head directory")
    p.add_argument("--data", type=Path, required=True, help="JSONL with a 'text' field per line, or a plain file")
    p.add_argument("--context", type=int, default=4096, help="prompt tokens (the longest prompt, cut to this)")
    p.add_argument("--policy", default="online", help="DiffSpec tree policy")
    p.add_argument("--tree-config", default="64:0.0:8", help="DiffSpec tree budget, total:threshold:depth")
    p.add_argument("--warm-steps", type=int, default=4, help="decode iterations before the profiled steady one")
    p.add_argument("--steps", nargs="+", choices=STEP_RANGES, default=list(STEP_RANGES),
                   help="which iterations to profile (each costs ncu about 0.3 s per kernel launch; "
                        "a step of the 8B-shaped pair launches 600-900)")
    p.add_argument("--out-dir", type=Path, default=Path("results/ncu"))
    p.add_argument("--ncu", help="the ncu executable (default: ncu on PATH)")
    p.add_argument("--report-only", action="store_true",
                   help="rewrite the tables from an earlier run's ncu_raw.csv and ncu_driver.json in --out-dir")
    p.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)  # the process ncu profiles
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    return drive(args) if args.driver else collect(args)


if __name__ == "__main__":
    sys.exit(main())
