"""The Triton attention backend inside the full target forward (GPU only)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from diffspec.sampling import SamplingParams
from diffspec.settings import DiffSpecSettings
from draft_service.options import DraftOptions
from gateway.assembly import build_engine
from gateway.request import GenerationRequest
from diffspec_kernels.attention_metadata import AttentionMetadata, causal_mask
from target_service.attention_backends import attention_backend
from target_service.runtime import TargetRuntime

pytestmark = pytest.mark.gpu


def _greedy(runtime: TargetRuntime, prompt: list[int], steps: int) -> list[int]:
    out = [runtime.prefill("s", prompt, SamplingParams(), want_features=False).first_token]
    out += [runtime.decode("s").bonus_token for _ in range(steps - 1)]
    runtime.release("s")
    return out


def test_triton_backend_greedy_equals_reference_over_256_steps(tiny_target_dir):
    prompt = torch.randint(3, 8192, (1500,), generator=torch.Generator().manual_seed(0)).tolist()
    common = dict(base_model=tiny_target_dir, device="cuda", dtype="float32", num_pages=512)
    ref = _greedy(TargetRuntime(DiffSpecSettings(attention_backend="torch", **common)), prompt, 256)
    got = _greedy(TargetRuntime(DiffSpecSettings(attention_backend="triton", **common)), prompt, 256)
    assert got == ref


def test_triton_backend_bf16_logits_match_reference(tiny_target_dir):
    """In bf16 the two backends round differently, so free-running greedy runs may part at a
    near-tie; on the same context their logits must agree to bf16 precision."""
    runtime = TargetRuntime(DiffSpecSettings(base_model=tiny_target_dir, device="cuda", dtype="bfloat16", num_pages=512))
    prompt = torch.randint(3, 8192, (2000,), generator=torch.Generator().manual_seed(1)).tolist()
    runtime.prefill("ctx", prompt[:1936], SamplingParams(), want_features=False)
    tail = torch.tensor(prompt[1936:], device="cuda")
    meta = AttentionMetadata.build(
        [64], [1936], [runtime.pool.block_table("ctx")], [causal_mask(64)], runtime.pool.page_size, runtime.device
    )
    positions = torch.arange(1936, 2000, device="cuda")
    logits = {}
    for name in ("torch", "triton"):
        out = runtime.model.forward_paged(
            tail, positions, runtime.cache.k_pages, runtime.cache.v_pages, meta, attention_backend(name)
        )
        logits[name] = runtime.model.logits(out.hidden)
    error = (logits["triton"] - logits["torch"]).norm() / logits["torch"].norm()
    assert error < 2e-2
    assert (logits["triton"].argmax(-1) == logits["torch"].argmax(-1)).float().mean() > 0.9


@pytest.mark.slow
def test_speculative_with_triton_equals_auto(tiny_target_dir):
    """With the default CUDA graphs: trees of every size the drafter makes, padded into buckets."""
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

    try:
        auto = asyncio.run(run(None))
        for options in (DraftOptions("full"), DraftOptions("online", salience=True)):
            assert asyncio.run(run(options)) == auto
    finally:
        engine.close()
