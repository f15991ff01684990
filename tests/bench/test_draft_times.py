"""bench/draft_times.py's host profile of one accept, on the CPU (the benchmark itself needs a GPU)."""

from __future__ import annotations

import pytest
import torch

from bench.draft_times import _host_profile, _kernel_profile, _python_profile


def test_the_host_profile_counts_the_ops_of_one_run_and_names_the_costliest():
    x = torch.ones(64)

    def work() -> None:
        for _ in range(3):
            x.add_(1)
        x.mul_(2)

    profile = _host_profile(work, "accept")
    assert profile["accept_ops"] == 4  # three adds and a multiply, not the conversions they call inside
    assert profile["accept_device_work"] == 0  # no GPU: nothing went to a device
    rows = {name: calls for name, calls, _ in profile["accept_costliest_host_ops"]}
    assert rows == {"aten::add_": 3, "aten::mul_": 1}
    assert float(x[0]) == 8.0  # the work ran once: (1 + 3) * 2


def test_the_python_profile_names_the_functions_that_cost_the_host_most():
    def build_lists() -> list[int]:
        values = []
        for value in range(200_000):  # a loop: its time is this function's own
            values.append(value)
        return values

    def work() -> None:
        for _ in range(3):
            build_lists()
        sorted(range(1000))

    rows = _python_profile(work, "start")["start_costliest_calls"]
    by_name = {where.split("(")[-1].rstrip(")"): (calls, own_ms) for where, calls, own_ms in rows}
    assert by_name["build_lists"][0] == 3 and by_name["<built-in method builtins.sorted>"][0] == 1
    assert rows[0][0].endswith("(build_lists)")  # the costliest first
    assert not any("_lsprof" in where for where, *_ in rows)  # the profiler's own calls are left out
    assert [own_ms for *_, own_ms in rows] == sorted((own_ms for *_, own_ms in rows), reverse=True)


def test_the_start_floor_counts_the_matmul_flops_a_long_start_runs():
    from torch.utils.flop_counter import FlopCounterMode

    from bench.draft_times import start_flops
    from diffspec.settings import BUNDLED_DRAFT, BUNDLED_TARGET
    from draft_service.drafter import KV_ONLY_MIN_ROWS, Drafter
    from draft_service.eagle3_head import Eagle3Head
    from draft_service.target_embedding import load_target_embedding

    device, dtype = torch.device("cpu"), torch.float32
    head = Eagle3Head.load(BUNDLED_DRAFT, load_target_embedding(BUNDLED_TARGET, device, dtype), device, dtype)
    drafter, positions = Drafter(head), KV_ONLY_MIN_ROWS + 88  # one chunk, long enough to skip its queries
    features = torch.randn(positions, 3 * head.config.target_hidden_size)
    with FlopCounterMode(display=False) as counter:
        drafter.start(list(range(positions)), features, 7)
    assert counter.get_total_flops() == start_flops(head, positions)  # the last row's query alone, nothing twice


@pytest.mark.gpu
def test_the_kernel_profile_sums_every_kernel_s_time():
    x = torch.ones(1024, 1024, device="cuda")
    profile = _kernel_profile(lambda: (x @ x, x + 1), "work")
    rows = profile["work_costliest_kernels"]
    assert profile["kernels_per_work"] == sum(launches for _, launches, _ in rows) >= 2  # the matmul and the add
    assert profile["work_kernel_ms"] > 0
    assert profile["work_kernel_ms"] == pytest.approx(sum(us for *_, us in rows) / 1e3, abs=1e-3)
