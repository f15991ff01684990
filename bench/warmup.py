"""Warm an in-process engine before timing: Triton compiles and CUDA-graph captures must not land in a timed run."""

from __future__ import annotations

from gateway.engine import SpeculativeEngine
from target_service.inprocess import InProcessTarget


def warm_up_target(engine: SpeculativeEngine) -> int:
    """Record the target's step graphs; returns how many (0 without graphs or with a remote target)."""
    return engine.target.runtime.warm_up() if isinstance(engine.target, InProcessTarget) else 0
