"""The engine profile's device-busy arithmetic: which intervals count as the device's work, their union
inside the iterations' windows, the idle gaps and the work either side of each, the device timeline's
refusal on a machine without a GPU, and the clock's phase times."""

from __future__ import annotations

import sys
import time

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import record_function

from bench.profile_generation import ITERATION, PhaseClockReport, _annotation, _on_device, busy_us, idle_gaps, main

# (iteration windows, device work intervals) -> microseconds the device is busy inside the windows
CASES = [
    ([(0, 10)], [], 0.0),
    ([(0, 10)], [(2, 4), (6, 8)], 4.0),  # gaps between kernels are idle
    ([(0, 10)], [(2, 6), (4, 8)], 6.0),  # overlapping kernels count once
    ([(0, 10)], [(-5, 3), (9, 20)], 4.0),  # work queued before or running past a window is clipped to it
    ([(0, 10), (20, 30)], [(5, 25)], 10.0),  # the host's time between iterations is not an iteration's
    ([(0, 10), (20, 30)], [(5, 12), (8, 9), (25, 40), (50, 60)], 10.0),
]


@pytest.mark.parametrize("windows, work, busy", CASES)
def test_busy_time_is_the_union_of_work_inside_the_windows(windows, work, busy):
    assert busy_us(windows, work) == busy


def test_marked_ranges_on_the_device_timeline_are_not_work():
    kernel = FunctionEvent(1, "nvjet_sm90_tst_128x8", 0, 0, 5, device_type=DeviceType.CUDA)
    repeated = FunctionEvent(2, "draft.propose.search", 0, 0, 50, device_type=DeviceType.CUDA)
    iteration = FunctionEvent(3, ITERATION, 0, 0, 100, device_type=DeviceType.CUDA)
    host = FunctionEvent(4, "aten::linear", 0, 0, 5)
    assert _on_device(kernel) and not _annotation(kernel)
    assert _on_device(repeated) and _annotation(repeated) and _annotation(iteration)
    assert not _on_device(host)


# device work (start, end, name) -> idle gaps (length, the last to end before, the first after)
GAP_CASES = [
    ([(0, 5, "a")], []),
    ([(0, 5, "a"), (5, 9, "b")], []),  # back to back: no gap
    ([(0, 5, "a"), (8, 9, "b")], [(3, "a", "b")]),
    ([(0, 10, "long"), (2, 4, "short"), (12, 13, "next")], [(2, "long", "next")]),  # the one that ended last
    ([(6, 9, "c"), (0, 5, "a"), (1, 2, "b")], [(1, "a", "c")]),  # any order in
    ([(0, 2, "a"), (4, 6, "b"), (9, 10, "a")], [(2, "a", "b"), (3, "b", "a")]),
]


@pytest.mark.parametrize("work, gaps", GAP_CASES)
def test_idle_gaps_are_named_by_the_kernels_on_either_side(work, gaps):
    assert idle_gaps(work) == gaps


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a GPU")
def test_the_device_timeline_is_refused_without_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["profile_generation", "--base-model", "m", "--draft-model", "d", "--data", "p",
                                      "--profiler", "timeline"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    assert "needs a GPU" in capsys.readouterr().err


def test_the_clock_times_each_marked_phase_inclusively_and_leaves_the_marks_as_they_were():
    report, enter = PhaseClockReport(), record_function.__enter__

    def step() -> None:
        with record_function("draft.propose"):
            time.sleep(0.01)
            with record_function("target.verify"):
                time.sleep(0.005)
        with record_function("elsewhere"):  # not a runtime's phase
            pass

    with report.active() as call:
        call(step)
        call(step)
    assert report.iterations == 2 and report.seconds >= 0.03
    assert report.phase_calls == {"draft.propose": 2, "target.verify": 2}
    assert report.phase_seconds["target.verify"] >= 0.01
    assert report.phase_seconds["draft.propose"] >= report.phase_seconds["target.verify"] + 0.02  # inclusive
    assert record_function.__enter__ is enter


class FakeClock:
    """``time.perf_counter`` that moves only when the test says the host or the device spent time: the path's
    arithmetic checked exactly, whatever else the machine runs."""

    def __init__(self) -> None:
        self.seconds = 100.0

    def now(self) -> float:
        return self.seconds

    def spend(self, seconds: float) -> None:
        self.seconds += seconds


def test_the_clock_times_the_host_s_path_from_a_verify_s_results_to_the_next_launch(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock.now)
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda event: clock.spend(0.002))  # the device's work
    report = PhaseClockReport()

    def step() -> None:
        with record_function("draft.propose"):
            clock.spend(0.004)
        with record_function("target.verify"):
            clock.spend(0.001)  # the inputs: the verify's own time on the path
            with record_function("target.verify.forward"):
                clock.spend(0.003)
            with record_function("target.verify.accept"):
                torch.cuda.Event.synchronize(None)  # the wait for the results: not on the path
                clock.spend(0.002)
        clock.spend(0.005)  # the loop's own work, in no phase

    with report.active() as call:
        for _ in range(3):
            call(step)
    assert report.paths == 2  # the first launch had no results before it
    per_path = {name: seconds / 2 for name, seconds in report.path_phase_seconds.items()}
    # each path: the accept's 2 ms after its wait, the loop's 5, the proposal's 4, the verify's 1 and its launch's 3
    assert report.path_seconds / 2 == pytest.approx(0.015)
    assert per_path["draft.propose"] == pytest.approx(0.004)
    assert per_path["target.verify.forward"] == pytest.approx(0.003)
    assert per_path["target.verify.accept"] == pytest.approx(0.002)  # the wait left out
    assert per_path["target.verify"] == pytest.approx(0.002 + 0.001 + 0.003)  # inclusive: accept's rest, inputs, launch
    unmarked = (report.path_seconds - report.path_marked_seconds) / 2
    assert unmarked == pytest.approx(0.005)
    assert report.wait_seconds == pytest.approx(3 * 0.002)
    assert report.seconds == pytest.approx(3 * 0.017)  # each iteration's wall time, the waits inside
