"""Parameter tables for the Triton-against-reference tests: the full set on a GPU, a small set everywhere."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest


def _values(case: Any) -> tuple[Any, ...]:
    return case if isinstance(case, tuple) else (case,)


def _value_id(value: Any) -> str:
    return str(value).removeprefix("torch.")


def kernel_cases(gpu: Iterable[Any], interpreted: Iterable[Any]) -> list[Any]:
    """``gpu`` cases marked gpu (skipped without one); ``interpreted`` cases, small enough for the Triton
    interpreter on CPU, marked interpreted and run on every machine. A tuple case fills several argnames."""

    def params(cases: Iterable[Any], mark: pytest.MarkDecorator) -> list[Any]:
        return [
            pytest.param(*_values(case), marks=mark, id=f"{mark.name}-{'-'.join(map(_value_id, _values(case)))}")
            for case in cases
        ]

    return params(gpu, pytest.mark.gpu) + params(interpreted, pytest.mark.interpreted)
