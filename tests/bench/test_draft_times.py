"""bench/draft_times.py's host profile of one accept, on the CPU (the benchmark itself needs a GPU)."""

from __future__ import annotations

import torch

from bench.draft_times import _host_profile


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
