"""Warming before timing: the draft's trees at the capacities a whole context stages, and the count of Triton kernels
compiled so far, which benchmarks compare before and after a timed run."""

from __future__ import annotations

import sys
import types
from collections import Counter

import pytest
import torch

import bench.warmup
from bench.warmup import triton_compiles, triton_kernels_compiled, warm_up_draft_over
from draft_service.runtime import DraftRuntime
from draft_service.tree_plan import SharedMeasurements, TreePlanner
from draft_service.tree_proposal import context_capacity
from tests.draft_service.test_drafter import load_head


def test_every_starting_tree_is_proposed_at_each_capacity_a_whole_context_stages_as_it_grows(monkeypatch):
    runtime = DraftRuntime(load_head(torch.device("cpu"), torch.float32), cuda_graphs=False)
    monkeypatch.setattr(bench.warmup, "records_or_compiles", lambda draft: True)  # as a GPU's draft would
    planner = TreePlanner.start(runtime.candidate_grid[0], SharedMeasurements(), runtime.candidate_grid)
    starting = {*planner.dynamic, *planner.probes, planner.shaped}
    depths = {len(c.plan) for c in starting}
    # a 1,536-token prompt stages 1,664 keys after its first token and 1,920 after 300 (capacities step by 128 here);
    # at each, every starting tree over the whole context (a working-set session's one capacity is the start's)
    assert warm_up_draft_over(types.SimpleNamespace(draft=runtime), 1536, 300) == 2 * len(starting)
    whole = runtime.drafter.proposer.shapes_met
    assert {shape.context for shape in whole} == {context_capacity(1537), context_capacity(1836)} == {1664, 1920}
    for capacity in (1664, 1920):
        assert {shape.depth for shape in whole if shape.context == capacity} == depths
    assert runtime.sessions == {}


def test_nothing_to_warm_without_a_draft_in_process_or_on_a_cpu():
    assert warm_up_draft_over(types.SimpleNamespace(draft=None), 65536, 128) == 0
    runtime = DraftRuntime(load_head(torch.device("cpu"), torch.float32), cuda_graphs=False)
    assert warm_up_draft_over(types.SimpleNamespace(draft=runtime), 1536, 300) == 0
    assert runtime.drafter.proposer.shapes_met == frozenset()


@pytest.fixture
def jit():  # noqa: ANN201 - the count is 0 by definition without Triton
    return pytest.importorskip("triton.runtime.jit")


def _probe(x_ptr):  # noqa: ANN001, ANN202 - a kernel body is never run here (``tl``: triton.language)
    tl.store(x_ptr, 0)  # noqa: F821


def test_compiles_of_every_diffspec_kernel_are_counted_once(jit, monkeypatch):
    kernel = jit.JITFunction(_probe)  # not triton.jit: under TRITON_INTERPRET that compiles nothing
    module = types.ModuleType("diffspec_kernels._compile_probe")
    module.kernel = module.alias = kernel  # one function under two names counts once
    outside = types.ModuleType("elsewhere._compile_probe")
    outside.kernel = jit.JITFunction(_probe)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(sys.modules, outside.__name__, outside)
    before = triton_kernels_compiled()
    # the cache a launch fills, per device: (compiled kernels by specialisation key, ...)
    kernel.device_caches["probe-device"] = ({"key-a": object(), "key-b": object()}, {}, None, None, None)
    outside.kernel.device_caches["probe-device"] = ({"key-c": object()}, {}, None, None, None)
    assert triton_kernels_compiled() - before == 2


def test_compiles_are_named_by_kernel(jit, monkeypatch):
    module = types.ModuleType("diffspec_kernels._named_probe")
    module.kernel = jit.JITFunction(_probe)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    before = triton_compiles()
    module.kernel.device_caches["probe-device"] = ({"key-a": object(), "key-b": object()}, {}, None, None, None)
    assert triton_compiles() - before == Counter({"_probe": 2})
