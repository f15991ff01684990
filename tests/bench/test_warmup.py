"""The count of Triton kernels compiled so far, which benchmarks compare before and after a timed run."""

from __future__ import annotations

import sys
import types
from collections import Counter

import pytest

from bench.warmup import triton_compiles, triton_kernels_compiled

jit = pytest.importorskip("triton.runtime.jit")  # the count is 0 by definition without Triton
tl = pytest.importorskip("triton.language")


def _probe(x_ptr):  # noqa: ANN001, ANN202 - a kernel body is never run here
    tl.store(x_ptr, 0)


def test_compiles_of_every_diffspec_kernel_are_counted_once(monkeypatch):
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


def test_compiles_are_named_by_kernel(monkeypatch):
    module = types.ModuleType("diffspec_kernels._named_probe")
    module.kernel = jit.JITFunction(_probe)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    before = triton_compiles()
    module.kernel.device_caches["probe-device"] = ({"key-a": object(), "key-b": object()}, {}, None, None, None)
    assert triton_compiles() - before == Counter({"_probe": 2})
