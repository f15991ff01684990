"""One generation through the engine's public API, timed from the client's side as well."""

from __future__ import annotations

import gc
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

import torch

from bench.bound_audits import audits_since, choices_json, engine_bound_audit
from bench.reproduce.arms import Arm
from bench.reproduce.draft_steps import DraftStep, take_draft_steps
from bench.reproduce.exactness import ExactnessResult
from bench.warmup import triton_compiles
from diffspec.sampling import SamplingParams
from gateway.request import GenerationChunk, GenerationRequest, GenerationStats
from target_service.backend import TargetInfo


class Engine(Protocol):
    """What the protocol needs of ``gateway.assembly.build_engine``'s object."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]: ...

    async def target_info(self) -> TargetInfo: ...


@dataclass
class RunRecord:
    """One prompt generated with one arm; times in seconds, tokens in target-vocab ids."""

    phase: str  # "tune" (first pass), "final" (the tuning finalists again) or "eval"
    dataset: str
    context: int  # the context target asked for (the prompt holds this many tokens)
    prompt: int  # index of the prompt within the dataset
    arm: str  # arm name
    label: str  # arm name plus its tree, e.g. diffspec[online 64:0.0:8]
    token_ids: list[int]  # [new_tokens] generated ids
    stats: GenerationStats
    request_seconds: float  # client wall time from the request to the last chunk
    first_token_seconds: float  # client wall time from the request to the first token
    peak_memory_bytes: int | None  # peak GPU memory allocated during the run (None on CPU)
    exactness: ExactnessResult | None = None  # against Auto's run of the same prompt (evaluation runs)
    draft_steps: list[DraftStep] = field(default_factory=list)  # [steps] per verification, with a recording engine
    kernels_compiled: int = 0  # Triton kernels compiled during the run: each costs its timing hundreds of ms
    compiled_kernels: list[str] = field(default_factory=list)  # their ``@triton.jit`` functions, one name per compile
    # "tokens:depth" -> what the batch planner predicted for each online bound and what the run's steps within it
    # delivered (``bench.bound_audits``); empty for fixed policies, Auto, or a draft in another process
    online_bound_audit: dict[str, dict] = field(default_factory=dict)
    # each choice of the online bound during the run, with every bound it scored (``bench.bound_audits.choices_json``)
    online_choices: list[dict] = field(default_factory=list)
    # what can stall a run besides its configuration (``PauseMeter``): collector seconds, allocator retries
    gc_seconds: float = 0.0
    allocator_retries: int = 0

    @property
    def end_to_end_tokens_per_second(self) -> float:
        return self.stats.new_tokens / self.request_seconds if self.request_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "phase": self.phase, "dataset": self.dataset, "context": self.context, "prompt": self.prompt,
            "arm": self.arm, "label": self.label, "token_ids": self.token_ids,
            "request_seconds": round(self.request_seconds, 6),
            "first_token_seconds": round(self.first_token_seconds, 6),
            "peak_memory_bytes": self.peak_memory_bytes, "stats": self.stats.to_dict(),
            "exactness": self.exactness.to_dict() if self.exactness else None,
            "draft_steps": [step.to_list() for step in self.draft_steps],
            "kernels_compiled": self.kernels_compiled,
            "compiled_kernels": self.compiled_kernels,
            "online_bound_audit": self.online_bound_audit,
            "online_choices": self.online_choices,
            "gc_seconds": round(self.gc_seconds, 6),
            "allocator_retries": self.allocator_retries,
        }


class PauseMeter:
    """What paused the process during a run, for a run that stalls: the seconds Python's cyclic garbage collector
    ran (every thread waits for it) and the CUDA caching allocator's retries (a failed allocation frees every cached
    block and synchronises the device before it tries again)."""

    def __init__(self) -> None:
        self.gc_seconds = 0.0
        self._collecting_since: float | None = None
        self._retries_before = self._retries()

    @staticmethod
    def _retries() -> int:
        return torch.cuda.memory_stats().get("num_alloc_retries", 0) if torch.cuda.is_available() else 0

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._collecting_since = time.perf_counter()
        elif self._collecting_since is not None:
            self.gc_seconds += time.perf_counter() - self._collecting_since
            self._collecting_since = None

    def __enter__(self) -> PauseMeter:
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_gc)

    @property
    def allocator_retries(self) -> int:
        return self._retries() - self._retries_before


async def generate_run(
    engine: Engine,
    prompt_ids: list[int],
    arm: Arm,
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    cache_scope: str | None = None,
) -> RunRecord:
    """Generate and time one request; the record's labels other than the arm's are left for the caller.
    ``cache_scope``: the prefix caches' scope (the request's client); None: one of its own, so its prefill is cold
    whatever ran before it."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    compiled_before, audit = triton_compiles(), engine_bound_audit(engine)
    audit_before, choices_before = audit.snapshot(), audit.choices_made
    tokens: list[int] = []
    stats: GenerationStats | None = None
    started = time.perf_counter()
    first_token_at = None
    scope = cache_scope if cache_scope is not None else f"run-{uuid.uuid4().hex}"
    request = GenerationRequest(prompt_ids, max_new_tokens, sampling=sampling, draft=arm.draft, client=scope)
    with PauseMeter() as pauses:
        async for chunk in engine.generate(request):
            if chunk.token_ids and first_token_at is None:
                first_token_at = time.perf_counter()
            tokens += chunk.token_ids
            stats = chunk.stats or stats
    ended = time.perf_counter()
    assert stats is not None, "the engine's last chunk carries the stats"
    compiled = sorted((triton_compiles() - compiled_before).elements())
    return RunRecord(
        phase="", dataset="", context=len(prompt_ids), prompt=0, arm=arm.name, label=arm.label,
        token_ids=tokens, stats=stats, request_seconds=ended - started,
        first_token_seconds=(first_token_at or ended) - started,
        peak_memory_bytes=torch.cuda.max_memory_allocated() if cuda else None,
        draft_steps=take_draft_steps(engine),
        kernels_compiled=len(compiled),
        compiled_kernels=compiled,
        online_bound_audit=audits_since(audit, audit_before),
        online_choices=choices_json(audit.choices_since(choices_before)),
        gc_seconds=pauses.gc_seconds,
        allocator_retries=pauses.allocator_retries,
    )
