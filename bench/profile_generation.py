"""Where the engine loop's time goes: a profile of the loop's thread while concurrent streams run.

Every model call runs on the engine thread, so one profile of that thread holds the whole
iteration: the draft call, the target call and the loop's own host work. Each mode runs once
untimed first after the warm-ups a server runs, so graph recording stays out of the profile.

``--profiler cprofile`` (the default) lists Python functions; a GPU's queued work shows up at
the calls that wait for it (a tensor read back to the host). ``--profiler torch`` lists the
phases the runtimes mark (``draft.accept``, ``draft.propose.search``, ``target.verify``, ...)
with their host time and the GPU time of the kernels they launched, how much of an iteration the device is
busy (all iterations, and those without prompt work: the idle rest is host time on the critical path), then
the costliest ops.
``--profiler timeline`` (a GPU only) records the device's kernels and copies alone, none of the host's ops, so
the host runs at its own speed: how long the device idles per iteration, and between which two kernels (the gap
after a step's last kernel is the host deciding what to launch next).
``--decode-only`` leaves the iterations that compute prompt chunks out of every report.
``--profiler clock`` times each marked phase's host work and the host's waits for the device (through CUDA
events) with the clock alone: no profiler or sampler beside the loop, so the host works at its own speed, and
an iteration's host work is what is left of it besides those waits.
``--profiler syncs`` (a GPU only) counts the host's waits for the GPU per iteration by source line.
``--profiler stacks`` samples the loop thread's Python stack on the wall clock: each function's share
of an iteration, waits for the GPU included, with no per-call cost added to what it measures.

    python -m bench.profile_generation --base-model .carry/b8/target --draft-model .carry/b8/head \
        --data .carry/data/shortctx_eval.jsonl --streams 16 --modes full-16 > bench/results/profile_engine.txt
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import cProfile
import json
import pstats
import sys
import threading
import time
from pathlib import Path
import warnings
from typing import Callable, Iterator
from unittest import mock

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from bench.batching import MODES, RequestSpec, concurrent
from bench.warmup import warm_up_draft, warm_up_target
from diffspec.settings import DiffSpecSettings
from gateway.assembly import build_engine

PHASE_PREFIXES = ("draft.", "target.")  # the ranges the runtimes mark
ITERATION = "engine.iteration"  # the range each profiled iteration is marked with
PROMPT_PHASE = "target.prefill"  # marked only where a target call computes prompt chunks
RESULTS_PHASE = "target.verify.accept"  # the target reads a verify's results inside it
LAUNCH_PHASE = "target.verify.forward"  # the target queues a verify's forward inside it
REPOSITORY = str(Path(__file__).resolve().parents[1])


class CProfileReport:
    """Python functions of the loop's thread, by own time and by cumulative time."""

    def __init__(self) -> None:
        self.profile = cProfile.Profile()

    @contextlib.contextmanager
    def active(self) -> Iterator[Callable[[Callable[[], None]], None]]:
        yield self.profile.runcall

    def print(self, rows: int) -> None:
        for order in ("tottime", "cumulative"):
            pstats.Stats(self.profile, stream=sys.stdout).sort_stats(order).print_stats(rows)


class TorchProfileReport:
    """The runtimes' marked phases (host and GPU time, per iteration), then the costliest ops."""

    def __init__(self) -> None:
        self.iterations = 0
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.profile = profile(activities=activities)

    @contextlib.contextmanager
    def active(self) -> Iterator[Callable[[Callable[[], None]], None]]:
        def call(step: Callable[[], None]) -> None:
            self.iterations += 1
            with record_function(ITERATION):
                step()

        with self.profile:
            yield call

    def print(self, rows: int) -> None:
        events = self.profile.key_averages()
        n = max(1, self.iterations)
        print(f"{n} iterations; per iteration: host ms (CPU total), GPU ms (device time of the kernels launched)")
        print(f"{'phase':32} {'calls/it':>8} {'host ms':>8} {'GPU ms':>8}")
        for event in sorted(events, key=lambda e: e.key):
            if event.key.startswith(PHASE_PREFIXES):
                host_ms, gpu_ms = event.cpu_time_total / 1e3 / n, event.device_time_total / 1e3 / n
                print(f"{event.key:32} {event.count / n:8.2f} {host_ms:8.3f} {gpu_ms:8.3f}")
        if torch.cuda.is_available():
            self._print_device_busy()
            self._print_gaps_by_phase(n, rows)
            self._print_kernels_by_phase(n)
            print(events.table(sort_by="self_cuda_time_total", row_limit=rows))
        print(events.table(sort_by="self_cpu_time_total", row_limit=rows))

    def _print_device_busy(self) -> None:
        events = self.profile.events()
        windows = [(e.time_range.start, e.time_range.end) for e in events if e.name == ITERATION and not _on_device(e)]
        prompts = [e.time_range.start for e in events if e.name == PROMPT_PHASE and not _on_device(e)]
        decoding = [w for w in windows if not any(w[0] <= start < w[1] for start in prompts)]
        work = [(e.time_range.start, e.time_range.end) for e in events if _on_device(e) and not _annotation(e)]
        for label, chosen in (("iterations", windows), ("iterations without prompt work", decoding)):
            if chosen:
                wall_ms = sum(end - start for start, end in chosen) / len(chosen) / 1e3
                busy_ms = busy_us(chosen, work) / len(chosen) / 1e3
                print(f"{len(chosen)} {label}: {wall_ms:.3f} ms each, the device busy {busy_ms:.3f} ms of it "
                      f"(idle {wall_ms - busy_ms:.3f} ms)")

    def _print_gaps_by_phase(self, iterations: int, rows: int) -> None:
        """The device's idle gaps named by the phase that launched the work on either side of each (a phase's host
        work before its first launch is what the device waits for); the profiler's own host cost lengthens them."""
        events = self.profile.events()
        if events and not hasattr(events[0], "linked_correlation_id"):
            print("(idle gaps by phase: this torch's profiler does not link a kernel to its launch; "
                  "--profiler timeline names them by kernel)")
            return
        launchers = {e.id: e for e in events if not _on_device(e) and e.linked_correlation_id == 0}
        work = []
        for event in events:
            if _on_device(event) and not _annotation(event):
                launcher = launchers.get(event.linked_correlation_id)
                phase = _innermost_phase(launcher) if launcher is not None else "?"
                work.append((event.time_range.start, event.time_range.end, f"{phase} {event.name[:40]}"))
        if work:
            print_gaps(idle_gaps(work), iterations, rows)

    def _print_kernels_by_phase(self, iterations: int, per_phase: int = 10) -> None:
        """Each phase's kernels (a graph's included, under the phase that replayed it): how many per iteration,
        their GPU time, and the costliest by name; a phase of many tiny kernels is launch-bound."""
        kernels: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        counts: collections.Counter[str] = collections.Counter()
        for event in self.profile.events():
            if not event.kernels:
                continue
            phase = _innermost_phase(event)
            for kernel in event.kernels:
                kernels[phase][kernel.name[:70]] += kernel.duration
                counts[phase] += 1
        print(f"{'phase':32} {'kernels/it':>10} {'GPU ms/it':>9}  costliest kernels (us per iteration)")
        for phase in sorted(kernels):
            total_ms = sum(kernels[phase].values()) / 1e3 / iterations
            print(f"{phase:32} {counts[phase] / iterations:10.1f} {total_ms:9.3f}")
            for name, us in kernels[phase].most_common(per_phase):
                print(f"{'':34}{us / iterations:9.1f}  {name}")


class TimedIterations:
    """The iterations a report ran and their wall seconds: its ``timed`` runs one."""

    def __init__(self) -> None:
        self.iterations = 0
        self.seconds = 0.0

    def timed(self, step: Callable[[], None]) -> None:
        self.iterations += 1
        started = time.perf_counter()
        step()
        self.seconds += time.perf_counter() - started


class PhaseClockReport(TimedIterations):
    """Each marked phase's host wall time per iteration (waits inside it included) and the host's waits for the
    device through CUDA events, from the clock: the marks' own few microseconds are in every run anyway.

    It also times the host's path from one verify's results to the next verify's launch: from the end of the
    last wait inside ``RESULTS_PHASE`` to the end of the next ``LAUNCH_PHASE``. The device runs only what was
    queued before the results (the draft's work behind the verify) while the host walks that path, so the
    part of it longer than that work is the device's idle time, and each phase's share of it says where."""

    def __init__(self) -> None:
        super().__init__()
        self.wait_seconds = 0.0
        self.phase_seconds: collections.Counter[str] = collections.Counter()
        self.phase_calls: collections.Counter[str] = collections.Counter()
        self.paths = 0  # spans from a verify's results to the next launch
        self.path_seconds = 0.0
        self.path_phase_seconds: collections.Counter[str] = collections.Counter()  # each phase's time inside them
        self.path_marked_seconds = 0.0  # the outermost phases' time inside them: the rest is unmarked host work
        self._open: list[tuple[str, float]] = []  # the marks entered and not left (name, when), outermost first
        self._path_from: float | None = None  # when the open span began
        self._path_phases: collections.Counter[str] = collections.Counter()  # the open span's, kept if it ends
        self._path_marked = 0.0

    @contextlib.contextmanager
    def active(self) -> Iterator[Callable[[Callable[[], None]], None]]:
        enter, leave = record_function.__enter__, record_function.__exit__

        def timed_enter(mark: record_function) -> record_function:
            self._open.append((mark.name, time.perf_counter()))
            return enter(mark)

        def timed_exit(mark: record_function, *exc: object) -> None:
            leave(mark, *exc)
            if not self._open:  # entered before the clock started
                return
            name, began = self._open.pop()  # marks nest: the last one entered is the one left
            if name.startswith(PHASE_PREFIXES):
                self._phase_left(name, began, time.perf_counter())

        with contextlib.ExitStack() as patches:
            patches.enter_context(mock.patch.object(record_function, "__enter__", timed_enter))
            patches.enter_context(mock.patch.object(record_function, "__exit__", timed_exit))
            # patched on any machine: where there is no CUDA nothing calls it
            patches.enter_context(mock.patch.object(torch.cuda.Event, "synchronize", self._timed_wait()))
            yield self.timed

    def _phase_left(self, name: str, began: float, now: float) -> None:
        self.phase_seconds[name] += now - began
        self.phase_calls[name] += 1
        if self._path_from is None:
            return
        self._count_on_path(name, began, now, outermost=not self._phases_open())
        if name == LAUNCH_PHASE:  # the span ends: the phases still open spent their part of it
            for i, (open_name, open_began) in enumerate(self._open):
                if open_name.startswith(PHASE_PREFIXES):
                    self._count_on_path(open_name, open_began, now, outermost=not self._phases_open(i))
            self.path_seconds += now - self._path_from
            self.paths += 1
            self.path_phase_seconds += self._path_phases
            self.path_marked_seconds += self._path_marked
            self._path_from = None

    def _count_on_path(self, name: str, began: float, now: float, outermost: bool) -> None:
        assert self._path_from is not None
        inside = now - max(began, self._path_from)
        self._path_phases[name] += inside
        if outermost:
            self._path_marked += inside

    def _phases_open(self, below: int | None = None) -> bool:
        """Whether a runtime's phase is open (among the first ``below`` marks open, if given)."""
        return any(name.startswith(PHASE_PREFIXES) for name, _ in self._open[:below])

    def _timed_wait(self) -> Callable[[torch.cuda.Event], None]:
        wait = torch.cuda.Event.synchronize

        def timed(event: torch.cuda.Event) -> None:
            began = time.perf_counter()
            wait(event)
            ended = time.perf_counter()
            self.wait_seconds += ended - began
            if any(name == RESULTS_PHASE for name, _ in self._open):
                # the last wait there is the one for the results: a span starts (again)
                self._path_from, self._path_phases, self._path_marked = ended, collections.Counter(), 0.0

        return timed

    def print(self, rows: int) -> None:
        n = max(1, self.iterations)
        iteration_ms, wait_ms = 1000 * self.seconds / n, 1000 * self.wait_seconds / n
        print(f"{n} iterations: {iteration_ms:.3f} ms each; the host waits for the device {wait_ms:.3f} ms of it "
              f"(through CUDA events) and works {iteration_ms - wait_ms:.3f} ms")
        print(f"{'phase':32} {'calls/it':>8} {'host ms/it':>10}  (waits inside a phase included)")
        for name, seconds in sorted(self.phase_seconds.items(), key=lambda item: -item[1])[:rows]:
            print(f"{name:32} {self.phase_calls[name] / n:8.2f} {1000 * seconds / n:10.3f}")
        if not self.paths:
            return
        paths, path_ms = self.paths, 1000 * self.path_seconds / self.paths
        print(f"the host's path from a verify's results to the next verify's launch: {path_ms:.3f} ms "
              f"({paths} of them)")
        print(f"{'phase on it':32} {'ms/path':>8}")
        for name, seconds in sorted(self.path_phase_seconds.items(), key=lambda item: -item[1])[:rows]:
            print(f"{name:32} {1000 * seconds / paths:8.3f}")
        unmarked_ms = 1000 * (self.path_seconds - self.path_marked_seconds) / paths
        print(f"{'(no phase: the loop, unmarked)':32} {unmarked_ms:8.3f}")


class SyncReport(TimedIterations):
    """Every wait of the host for the GPU inside the loop, by source line (torch's sync debug mode warns
    at each one): a step should wait once for its draft trees and once for its verify results."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter[str] = collections.Counter()

    @contextlib.contextmanager
    def active(self) -> Iterator[Callable[[Callable[[], None]], None]]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield self.timed
            finally:
                torch.cuda.set_sync_debug_mode("default")
        self.sites.update(f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))

    def print(self, rows: int) -> None:
        n = max(1, self.iterations)
        print(f"{n} iterations; {sum(self.sites.values()) / n:.2f} host waits for the GPU per iteration")
        for site, count in self.sites.most_common(rows):
            print(f"{count / n:8.2f}  {site}")


class StackSampleReport(TimedIterations):
    """Wall-clock samples of the loop thread's Python stack, every ``interval`` seconds.

    A sampling thread needs the GIL to read another thread's frames, so the interpreter's switch
    interval is lowered to a fraction of the sampling interval while it runs: the loop thread then
    yields the GIL that often and the samples land where its time goes, not only at its waits.
    """

    def __init__(self, interval: float = 0.0002) -> None:
        super().__init__()
        self.interval = interval
        self.stacks: collections.Counter[tuple[str, ...]] = collections.Counter()  # outermost first

    @contextlib.contextmanager
    def active(self) -> Iterator[Callable[[Callable[[], None]], None]]:
        stop, loop_thread = threading.Event(), threading.get_ident()
        sampler = threading.Thread(target=self._sample, args=(loop_thread, stop), daemon=True)
        switch = sys.getswitchinterval()
        sys.setswitchinterval(self.interval / 4)
        sampler.start()
        try:
            yield self.timed
        finally:
            stop.set()
            sampler.join()
            sys.setswitchinterval(switch)

    def _sample(self, thread: int, stop: threading.Event) -> None:
        while not stop.wait(self.interval):
            frame = sys._current_frames().get(thread)
            stack = []
            while frame is not None and frame.f_code.co_name != "_profiled_loop":
                stack.append(f"{_short(frame.f_code.co_filename)}:{frame.f_code.co_qualname}:{frame.f_lineno}")
                frame = frame.f_back
            if frame is not None:  # inside an iteration
                self.stacks[tuple(reversed(stack))] += 1

    def print(self, rows: int) -> None:
        total = max(1, sum(self.stacks.values()))
        ms_per_sample = 1000 * self.seconds / max(1, self.iterations) / total
        inclusive: collections.Counter[str] = collections.Counter()
        leaves: collections.Counter[str] = collections.Counter()
        for stack, count in self.stacks.items():
            inclusive.update({site.rsplit(":", 1)[0]: count for site in stack})
            leaves[stack[-1] if stack else "?"] += count
        print(f"{self.iterations} iterations, {1000 * self.seconds / max(1, self.iterations):.2f} ms each, "
              f"{total} samples; ms per iteration by function (inclusive), then by line (where the time is spent)")
        for table in (inclusive, leaves):
            for site, count in table.most_common(rows):
                print(f"{count * ms_per_sample:8.3f}  {site}")
            print()


class DeviceTimelineReport(TimedIterations):
    """The device's own timeline, kernels and copies only: no host op is recorded, so the idle time it
    shows is the host's, not a profiler's. Each idle gap is named by the kernels on either side of it."""

    def __init__(self) -> None:
        super().__init__()
        self.profile = profile(activities=[ProfilerActivity.CUDA])

    @contextlib.contextmanager
    def active(self) -> Iterator[Callable[[Callable[[], None]], None]]:
        with self.profile:
            yield self.timed
            torch.cuda.synchronize()

    def print(self, rows: int) -> None:
        work = [(e.time_range.start, e.time_range.end, e.name) for e in self.profile.events()
                if _on_device(e) and not _annotation(e)]  # fmt: skip
        if not work:
            print("no device work recorded")
            return
        n = max(1, self.iterations)
        span_us = max(end for _, end, _ in work) - min(start for start, _, _ in work)
        gaps = idle_gaps(work)
        idle_us = sum(gap for gap, _, _ in gaps)
        print(f"{n} iterations: {span_us / n / 1e3:.3f} ms each from the first kernel to the last, the device "
              f"busy {(span_us - idle_us) / n / 1e3:.3f} ms (idle {idle_us / n / 1e3:.3f} ms)")
        print_gaps(gaps, n, rows)


def print_gaps(gaps: list[tuple[float, str, str]], iterations: int, rows: int) -> None:
    """The idle gaps summed per (before, after) pair, the longest total first."""
    by_pair: collections.Counter[tuple[str, str]] = collections.Counter()
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    for gap, before, after in gaps:
        by_pair[before, after] += gap
        counts[before, after] += 1
    print(f"{'idle ms/it':>10} {'gaps/it':>8}  the work before the gap -> the work after it")
    for (before, after), us in by_pair.most_common(rows):
        print(f"{us / iterations / 1e3:10.3f} {counts[before, after] / iterations:8.2f}  {before[:70]} -> {after[:70]}")


def idle_gaps(work: list[tuple[float, float, str]]) -> list[tuple[float, str, str]]:
    """The device's idle gaps in ``work`` (start, end, name): (length, the name of the interval that ended last
    before the gap, the name of the first after it); overlapping intervals are busy once."""
    gaps = []
    ordered = sorted(work)
    last_end, last_name = ordered[0][1], ordered[0][2]
    for start, end, name in ordered[1:]:
        if start > last_end:
            gaps.append((start - last_end, last_name, name))
        if end > last_end:
            last_end, last_name = end, name
    return gaps


def busy_us(windows: list[tuple[float, float]], work: list[tuple[float, float]]) -> float:
    """Microseconds of the (disjoint) ``windows`` during which at least one interval of ``work`` runs: the
    intervals' union, clipped to each window."""
    union: list[list[float]] = []
    for start, end in sorted(work):
        if union and start <= union[-1][1]:
            union[-1][1] = max(union[-1][1], end)
        else:
            union.append([start, end])
    return sum(max(0.0, min(end, w_end) - max(start, w_start)) for w_start, w_end in windows for start, end in union)


def _on_device(event) -> bool:  # noqa: ANN001 (a torch.autograd.profiler FunctionEvent)
    return event.device_type != DeviceType.CPU


def _annotation(event) -> bool:  # noqa: ANN001
    """A marked range as the device timeline repeats it (it spans gaps between kernels: not work)."""
    return event.is_user_annotation or event.name == ITERATION or event.name.startswith(PHASE_PREFIXES)


def _short(path: str) -> str:
    """A source path from its package down: the repository's or site-packages' prefix cut off."""
    for prefix in (f"{REPOSITORY}/", "site-packages/"):
        if prefix in path:
            return path.split(prefix, 1)[1]
    return path


def _innermost_phase(event) -> str:  # noqa: ANN001 (a torch.autograd.profiler FunctionEvent)
    """The closest enclosing range the runtimes mark, or "loop" for work outside every phase."""
    while event is not None:
        if event.name.startswith(PHASE_PREFIXES):
            return event.name
        event = event.cpu_parent
    return "loop"


REPORTS = {"cprofile": CProfileReport, "torch": TorchProfileReport, "timeline": DeviceTimelineReport,
           "clock": PhaseClockReport, "syncs": SyncReport, "stacks": StackSampleReport}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-model", type=Path, required=True)
    parser.add_argument("--draft-model", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--modes", nargs="+", default=["full-16"], choices=list(MODES))
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--profiler", choices=list(REPORTS), default="cprofile")
    parser.add_argument("--rows", type=int, default=30, help="functions or ops listed per table")
    parser.add_argument("--decode-only", action="store_true", help="profile from the first iteration without "
                        "prompt work on (the prompt's chunks run first, outside the profile)")
    args = parser.parse_args()
    if args.profiler == "timeline" and not torch.cuda.is_available():
        parser.error("--profiler timeline records the GPU's timeline: it needs a GPU")
    settings = DiffSpecSettings(base_model=args.base_model, draft_model=args.draft_model, num_pages=8192)
    engine = build_engine(settings)
    engine.core.detach_loop()  # the loop runs in this thread instead, under the profiler
    warm_up_target(engine)  # as a server before traffic: no graph recording inside the profiled runs
    warm_up_draft(engine)
    texts = [json.loads(line)["text"] for line in args.data.read_text().splitlines()[: args.streams]]
    prompts = [engine.tokenizer(t)["input_ids"][-args.prompt_tokens :] for t in texts]
    for mode in args.modes:
        for report in (REPORTS[args.profiler](), REPORTS[args.profiler]()):  # the first run records graphs, untimed
            asyncio.run(_run(engine, prompts, mode, args.max_new_tokens, report, args.decode_only))
        print(f"==== {mode}, {args.streams} streams, {args.max_new_tokens} new tokens each ====")
        report.print(args.rows)
    return 0


async def _run(engine, prompts, mode: str, max_new_tokens: int, report, decode_only: bool) -> None:  # noqa: ANN001
    streams = asyncio.ensure_future(
        concurrent(engine, [[ids] for ids in prompts], RequestSpec(MODES[mode], max_new_tokens))
    )
    await asyncio.sleep(0.05)  # every request is in the inbox
    await asyncio.to_thread(_profiled_loop, engine.core, report, decode_only)
    await streams


def _profiled_loop(core, report, decode_only: bool) -> None:  # noqa: ANN001
    """Run ``core``'s iterations under ``report``'s profiler while it has work (this thread stands in for the
    loop's); with ``decode_only``, the iterations up to the first that verifies without prompt work run first,
    outside it."""
    verified_alone = core.timing.verify_only_iterations
    while decode_only and core.has_work() and core.timing.verify_only_iterations == verified_alone:
        core.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the prompt's queued work stays out of the profile
    with report.active() as call:
        while core.has_work():
            call(core.step)


if __name__ == "__main__":
    sys.exit(main())
