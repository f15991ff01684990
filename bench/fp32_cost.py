"""What the exactness rule's fp32 runs cost, prefill and decode apart, per attention backend and prompt length.

Judging a divergence at 32K-64K on an 8B target takes minutes of GPU time, nearly all of it in the rule's fp32
runs (``bench/reproduce/fp32_rerun.py``), each of which prefills the whole prompt in fp32. Without tensor
cores the prefill's attention grows with the square of the prompt while its matmuls grow linearly; this
says which part dominates at each length, and whether the PyTorch reference attention (cuBLAS fp32 matmuls)
or the Triton kernel (fp32 dots) prefills faster, so the judging can use the cheaper one. Prompts are random
token ids: the cost does not depend on the text. One untimed short run per backend compiles its kernels
first.

    python -m bench.fp32_cost --base-model /tmp/b8/target --draft-model /tmp/b8/head --prompt-tokens 4096 16384 --out bench/results/fp32_cost_8b.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from bench.reproduce.fp32_rerun import Fp32Rerun
from diffspec.model_config import load_llama_config
from diffspec.settings import DiffSpecSettings

WARMUP_TOKENS = 64  # the untimed first prompt's length


def random_prompt(num_tokens: int, vocab_size: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_tokens,), generator=generator).tolist()


def measure(settings: DiffSpecSettings, backend: str, lengths: list[int], max_new_tokens: int,
            vocab_size: int) -> list[dict]:  # fmt: skip
    """One fp32 Auto run per length through an engine sized once for the longest, as the judging builds it."""
    rerun = Fp32Rerun(settings.model_copy(update={"attention_backend": backend}), reserve_tokens=max(lengths))
    rows = []
    try:
        rerun.auto_run(random_prompt(WARMUP_TOKENS, vocab_size, seed=0), 2)
        for length in lengths:
            stats = rerun.auto_run(random_prompt(length, vocab_size, seed=length), max_new_tokens).stats
            rows.append({
                "backend": backend, "prompt_tokens": length, "prefill_s": round(stats.prefill_seconds, 3),
                "prefill_tokens_per_s": round(length / stats.prefill_seconds),
                "decode_ms_per_step": round(1e3 * stats.decode_seconds / max(stats.steps, 1), 2),
                "steps": stats.steps,
            })
            print(json.dumps(rows[-1]), flush=True)
    finally:
        rerun.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-model", type=Path, required=True)
    parser.add_argument("--draft-model", type=Path, required=True, help="loaded with the engine, as the rule's runs do")
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--backends", nargs="+", default=["triton", "torch"], choices=["triton", "torch"])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    settings = DiffSpecSettings(base_model=args.base_model, draft_model=args.draft_model)
    vocab_size = load_llama_config(args.base_model).vocab_size
    rows = [row for backend in args.backends
            for row in measure(settings, backend, args.prompt_tokens, args.max_new_tokens, vocab_size)]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    args.out.write_text(json.dumps({"device": device, "max_new_tokens": args.max_new_tokens, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
