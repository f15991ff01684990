"""The evidence behind a near-tie verdict: the target replayed with ``transformers`` (the reference
implementation the project's forward is tested against), in fp32 and in the serving dtype.

At a divergence the shared prefix (prompt + the tokens both generations agree on) is prefilled
once per dtype into a KV cache, in chunks so that a 64K prefix fits. Then:
- fp32: one decode of the last prefix token gives the top-2 logits at the divergence;
- serving dtype: the same position's logits from a 1-token decode and from a ``verify_tokens``-token
  forward (the last prefix token followed by later ones, as a verification feeds it). Causal
  masking makes the two equal in exact arithmetic; their largest difference is the spread.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaForCausalLM

from bench.reproduce.exactness import TieEvidence

PREFILL_CHUNK_TOKENS = 4096  # bounds activation memory of the replay's prefill


class TargetReplay:
    """Loads the target lazily (only a divergence needs it) and caches evidence per prefix."""

    def __init__(self, base_model: Path, serving_dtype: torch.dtype, device: torch.device) -> None:
        self.base_model = base_model
        self.serving_dtype = serving_dtype
        self.device = device
        self._fp32: LlamaForCausalLM | None = None
        self._serving: LlamaForCausalLM | None = None
        self._evidence: dict[tuple[tuple[int, ...], int], TieEvidence] = {}

    def evidence(self, prefix_ids: list[int], following_ids: list[int], verify_tokens: int) -> TieEvidence:
        """Replays at the position after ``prefix_ids``; ``following_ids`` fill out the verify forward."""
        key = (tuple(prefix_ids), verify_tokens)
        if key not in self._evidence:
            fp32_logits = self._decode_logits(self._models()[0], prefix_ids)
            top = torch.topk(fp32_logits, 2)
            spread = self._spread(self._models()[1], prefix_ids, following_ids, verify_tokens)
            self._evidence[key] = TieEvidence(
                fp32_top1=int(top.indices[0]), fp32_top2=int(top.indices[1]),
                fp32_margin=float(top.values[0] - top.values[1]), spread=spread,
            )
        return self._evidence[key]

    def _models(self) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
        if self._fp32 is None:
            self._fp32 = LlamaForCausalLM.from_pretrained(str(self.base_model), dtype=torch.float32).to(self.device)
            self._fp32.eval()
            # the checkpoint's weights are exact in the serving dtype, so a cast reproduces them
            same = self.serving_dtype == torch.float32
            self._serving = self._fp32 if same else copy.deepcopy(self._fp32).to(self.serving_dtype)
        assert self._serving is not None
        return self._fp32, self._serving

    @torch.inference_mode()
    def _prefill(self, model: LlamaForCausalLM, ids: list[int]) -> DynamicCache:
        cache = DynamicCache()
        for start in range(0, len(ids), PREFILL_CHUNK_TOKENS):
            chunk = torch.tensor([ids[start:start + PREFILL_CHUNK_TOKENS]], device=self.device)
            model(input_ids=chunk, past_key_values=cache, use_cache=True)
        return cache

    @torch.inference_mode()
    def _forward_rows(self, model: LlamaForCausalLM, cache: DynamicCache, ids: list[int]) -> torch.Tensor:
        out = model(input_ids=torch.tensor([ids], device=self.device), past_key_values=cache, use_cache=True)
        return out.logits[0].float()  # [len(ids), vocab]

    def _decode_logits(self, model: LlamaForCausalLM, prefix_ids: list[int]) -> torch.Tensor:
        cache = self._prefill(model, prefix_ids[:-1])
        return self._forward_rows(model, cache, prefix_ids[-1:])[0]  # [vocab]

    def _spread(self, model: LlamaForCausalLM, prefix_ids: list[int], following_ids: list[int], verify_tokens: int) -> float:
        cache = self._prefill(model, prefix_ids[:-1])
        verify_ids = (prefix_ids[-1:] + following_ids)[:max(verify_tokens, 2)]
        verify_ids += [verify_ids[-1]] * (max(verify_tokens, 2) - len(verify_ids))  # row 0 never sees them
        verify_row = self._forward_rows(model, copy.deepcopy(cache), verify_ids)[0]
        decode_row = self._forward_rows(model, cache, prefix_ids[-1:])[0]
        return float((verify_row - decode_row).abs().max())
