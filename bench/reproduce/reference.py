"""The outside reference arm: ``transformers`` ``generate`` on the same checkpoint, device and serving
dtype, greedy, so Auto's speed has an anchor outside this project's runtime.

It runs at the shortest evaluated context only (its attention over a growing ``DynamicCache`` is the
library's default path, not a long-context one), on the first ``--reference-prompts`` evaluated
prompts, after the engine's arms.
Times come from a streamer that ``generate`` hands every new token: the first is the end of prefill
(time to first token), the rest are decode. ``generate`` keeps the end-of-sequence token it stopped
on; the engine emits none, so it is cut off here and the token lists compare one to one.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import LlamaForCausalLM
from transformers.generation.streamers import BaseStreamer

from bench.reproduce.runs import RunRecord
from diffspec.devices import free_gpu_memory
from gateway.request import GenerationStats

REFERENCE = "transformers"


class _TokenClock(BaseStreamer):
    """``generate``'s streamer: the time of every new token (its first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.prompt_seen = False
        self.token_times: list[float] = []  # perf_counter() per generated token, in order

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.token_times.append(time.perf_counter())
        self.prompt_seen = True

    def end(self) -> None:
        pass


class TransformersReference:
    """Loads the target with ``transformers`` on first use; ``close`` frees it."""

    def __init__(self, base_model: Path, dtype: torch.dtype, device: torch.device, eos_token_ids: tuple[int, ...]) -> None:
        self.base_model = base_model
        self.dtype = dtype
        self.device = device
        self.eos_token_ids = eos_token_ids
        self._model: LlamaForCausalLM | None = None

    @property
    def label(self) -> str:
        return f"{REFERENCE}[generate {str(self.dtype).removeprefix('torch.')}]"

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> RunRecord:
        """One greedy generation, timed like the engine's runs; dataset labels are left for the caller."""
        model = self._load()
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        clock = _TokenClock()
        ids = torch.tensor([prompt_ids], device=self.device)
        eos = list(self.eos_token_ids) or None
        started = time.perf_counter()
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
            temperature=None, top_p=None, top_k=None, eos_token_id=eos, pad_token_id=eos[0] if eos else None,
            streamer=clock,
        )  # fmt: skip
        if cuda:
            torch.cuda.synchronize()
        ended = time.perf_counter()
        generated = out[0, len(prompt_ids):].tolist()
        ends_at_eos = next((i for i, t in enumerate(generated) if t in self.eos_token_ids), None)
        tokens = generated if ends_at_eos is None else generated[:ends_at_eos]
        first_token_at = clock.token_times[0] if clock.token_times else ended
        stats = GenerationStats(
            prompt_tokens=len(prompt_ids), new_tokens=len(tokens), steps=max(len(generated) - 1, 0),
            prefill_seconds=first_token_at - started,
            verify_seconds=ended - first_token_at,  # every decode forward, the library's host work included
            decode_seconds=ended - first_token_at,
            finish_reason="length" if ends_at_eos is None else "eos",
        )
        return RunRecord(
            phase="", dataset="", context=len(prompt_ids), prompt=0, arm=REFERENCE, label=self.label,
            token_ids=tokens, stats=stats, request_seconds=ended - started,
            first_token_seconds=first_token_at - started,
            peak_memory_bytes=torch.cuda.max_memory_allocated() if cuda else None,
        )

    def close(self) -> None:
        self._model = None
        free_gpu_memory()

    def _load(self) -> LlamaForCausalLM:
        if self._model is None:
            self._model = LlamaForCausalLM.from_pretrained(str(self.base_model), dtype=self.dtype).to(self.device)
            self._model.eval()
        return self._model
