"""Sampling parameters and the target distribution they define.

Temperature 0 means greedy (argmax). Above 0, logits are divided by the temperature, then
top-p keeps the smallest set of most likely tokens whose mass reaches ``top_p``. Speculative
acceptance and plain sampling both draw from exactly this distribution, which is what makes
speculation lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffspec.errors import InvalidRequest


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    seed: int | None = None  # fixes the random stream of one request

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature < float("inf"):
            raise InvalidRequest(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self) -> torch.Generator:
        """A CPU generator for this request's acceptance and sampling draws."""
        gen = torch.Generator()
        gen.manual_seed(self.seed if self.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        return gen


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., vocab] float32 logits -> the distribution sampling draws from (temperature > 0)."""
    # Shift before scaling: the largest logit becomes 0 and any temperature, however small, gives
    # finite values (a tiny temperature would otherwise overflow to inf - inf = NaN).
    logits = logits.float()
    probs = torch.softmax((logits - logits.amax(-1, keepdim=True)) / params.temperature, dim=-1)
    if params.top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    drop = mass_before >= params.top_p
    drop[..., 0] = False  # the most likely token always stays (a top_p below float32's range would drop it)
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a [vocab] distribution on the CPU generator."""
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())
