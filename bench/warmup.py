"""Warm an engine before timing: Triton compiles and CUDA-graph captures must not land in a timed run."""

from __future__ import annotations

import sys
from collections import Counter
from typing import AsyncIterator, Protocol

from cli.services import seed_verify_costs
from draft_service.options import DraftOptions
from draft_service.runtime import DraftRuntime
from draft_service.tree_proposal import context_capacity
from gateway.request import GenerationChunk, GenerationRequest
from target_service.runtime import TargetRuntime


class Generates(Protocol):
    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]: ...


def warm_up_target(engine: object) -> int:
    """Record the target's step graphs now; returns how many (0 without graphs, with a remote target,
    or with an engine that does not expose an in-process target: then the warm-up generations record them)."""
    target = getattr(engine, "target", None)
    return target.warm_up() if isinstance(target, TargetRuntime) else 0


def in_process_draft(engine: object) -> DraftRuntime | None:
    """The engine's draft runtime when it runs in this process, through a step recorder around it
    (``bench.reproduce.draft_steps``); None for a draft over gRPC."""
    draft = getattr(engine, "draft", None)
    draft = getattr(draft, "draft", draft)
    return draft if isinstance(draft, DraftRuntime) else None


def warm_up_draft(engine: object) -> int:
    """Propose once each tree an ``online`` session starts from (``DraftRuntime.warm_up``), so their kernels
    compile before timing, and hand the draft the verify costs the target timed at its warm-up; returns the
    proposals (0 without an in-process draft)."""
    draft = in_process_draft(engine)
    if draft is None:
        return 0
    seed_verify_costs(getattr(engine, "target", None), draft)
    return draft.warm_up()


def records_or_compiles(draft: DraftRuntime) -> bool:
    """Whether a proposal at a new shape records a graph or compiles a kernel: on a GPU only (a CPU runs the
    kernels' PyTorch references or the Triton interpreter, so its warm-up would only cost the tests time)."""
    return draft.head.fc.weight.is_cuda


def warm_up_draft_over(engine: object, context_tokens: int, new_tokens: int) -> int:
    """``warm_up_draft``'s trees over a whole context of ``context_tokens`` prompt tokens, at each capacity it
    stages as it grows by up to ``new_tokens``: a session drafting over its whole context stages it at a capacity of
    its length, and each tree's graph is recorded there the first time it comes (``tree_proposal``), so without
    this the trees an ``online`` session reaches after its start would be recorded inside timed runs (on an H100
    at 4K and 16K, 5-6% of the first such arm's decode). A working-set session stages its budget whatever its
    length: ``warm_up_draft`` covered it. Returns the proposals made (0 without an in-process draft on a GPU)."""
    draft = in_process_draft(engine)
    if draft is None or not records_or_compiles(draft):
        return 0
    capacities = {context_capacity(context_tokens + grown) for grown in (1, new_tokens)}
    return sum(draft.warm_up(capacity, whole_context_only=True) for capacity in sorted(capacities))


def triton_compiles() -> Counter[str]:
    """Triton compiles so far by this process, per ``@triton.jit`` function of the loaded ``diffspec_kernels``
    modules (empty without Triton): a compile inside a timed run costs hundreds of milliseconds, so a run
    whose counts grow is not steady state, and the kernel's name says which warm-up missed it."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return Counter()
    functions = {
        id(value): value
        for name, module in list(sys.modules.items())
        if name.startswith("diffspec_kernels.") and module is not None
        for value in vars(module).values()
        if isinstance(value, JITFunction)
    }
    compiles: Counter[str] = Counter()
    for function in functions.values():
        for caches in function.device_caches.values():
            compiles[function.__name__] += len(caches[0])
    return +compiles


def triton_kernels_compiled() -> int:
    """All of ``triton_compiles``."""
    return sum(triton_compiles().values())


async def warm_up_generations(
    engine: Generates, prompt_ids: list[int], drafts: list[DraftOptions | None], max_new_tokens: int, client: str = ""
) -> None:
    """One short untimed generation per configuration at this prompt's context (the draft's graphs
    are recorded per context capacity, so every length needs its own), as ``client`` (its prefix caches' scope)."""
    for draft in drafts:
        async for _ in engine.generate(GenerationRequest(prompt_ids, max_new_tokens, draft=draft, client=client)):
            pass
