"""The Triton attention backend inside the full target forward (GPU only)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from diffspec.sampling import SamplingParams
from diffspec.settings import DiffSpecSettings
from draft_service.backend import DraftOptions
from gateway.assembly import build_engine
from gateway.request import GenerationRequest
from target_service.runtime import TargetRuntime

pytestmark = pytest.mark.gpu


def _greedy(runtime: TargetRuntime, prompt: list[int], steps: int) -> list[int]:
    out = [runtime.prefill("s", prompt, SamplingParams(), want_features=False).first_token]
    out += [runtime.decode("s").bonus_token for _ in range(steps - 1)]
    runtime.release("s")
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_backend_greedy_equals_reference_over_256_steps(tiny_target_dir, dtype):
    prompt = torch.randint(3, 8192, (1500,), generator=torch.Generator().manual_seed(0)).tolist()
    common = dict(base_model=tiny_target_dir, device="cuda", dtype=dtype, num_pages=512, prefill_chunk=512)
    ref = _greedy(TargetRuntime(DiffSpecSettings(attention_backend="torch", **common)), prompt, 256)
    got = _greedy(TargetRuntime(DiffSpecSettings(attention_backend="triton", **common)), prompt, 256)
    if dtype == "float32":
        assert got == ref
    else:  # bf16 rounding may flip a near-tie late on; the runs must agree for a long prefix
        same = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), len(ref))
        assert same >= 64, f"diverged at step {same}"


def test_speculative_with_triton_equals_auto(tiny_target_dir):
    settings = DiffSpecSettings(
        base_model=tiny_target_dir, device="cuda", dtype="float32", attention_backend="triton", num_pages=512
    )
    engine = build_engine(settings)
    ids = engine.tokenizer("import os\nimport sys\n\n\ndef main(argv):")["input_ids"]

    async def run(options):
        tokens = []
        async for chunk in engine.generate(GenerationRequest(ids, 128, draft=options)):
            tokens += chunk.token_ids
        return tokens

    auto = asyncio.run(run(None))
    for options in (DraftOptions("full"), DraftOptions("online", salience=True)):
        assert asyncio.run(run(options)) == auto
