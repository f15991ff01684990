"""What a request asks of sampling, and the log-probabilities it gets back: torch-free, so a gateway
can check and carry them without the model's libraries (the distributions are ``diffspec/sampling.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from diffspec.errors import InvalidRequest
from diffspec.model_config import GenerationConfig

if TYPE_CHECKING:
    import torch

MAX_LOGPROBS = 20  # most alternatives reported per token (OpenAI's top_logprobs bound)
_SEED_STRIDE = 0x9E3779B97F4A7C15  # odd 64-bit constant: sample i's seed = seed + i * stride (mod 2^63)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    seed: int | None = None  # fixes the random stream of one request
    top_k: int = 0  # most likely tokens kept before top-p; 0 = all
    logprobs: int | None = None  # alternatives reported beside each emitted token's logprob; None = no logprobs

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature < float("inf"):
            raise InvalidRequest(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 = all tokens), got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self) -> torch.Generator:
        """A CPU generator for this request's acceptance and sampling draws."""
        import torch  # called where the target samples, which has torch loaded

        gen = torch.Generator()
        gen.manual_seed(self.seed if self.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        return gen

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of sample ``index`` of n: sample 0 keeps the seed, the others get distinct seeds
        derived from it (unseeded stays unseeded: each sample draws its own)."""
        if index == 0 or self.seed is None:
            return self
        return dataclasses.replace(self, seed=(self.seed + index * _SEED_STRIDE) % 2**63)


@dataclass(frozen=True)
class SamplingDefaults:
    """The checkpoint's sampling defaults (its generation_config.json, as vLLM's ``--generation-config auto``
    reads it): what a request's unset temperature, top_p, top_k and max_new_tokens become before the
    front end's own defaults. A field the request sets wins; ``gateway/messages.py`` applies them, for
    every front end."""

    temperature: float | None = None  # None = the front end's default (gRPC and the CLI: 0, HTTP: 1)
    top_p: float | None = None  # None = 1
    top_k: int | None = None  # None = 0 (all tokens)
    max_new_tokens: int | None = None  # tokens; None = the server's --max-new-tokens

    @staticmethod
    def of(config: GenerationConfig) -> SamplingDefaults:
        """Those of a parsed generation_config.json (the sampling ones set only when its ``do_sample`` is
        true, ``max_new_tokens`` whenever it is there, as vLLM reads it)."""
        return SamplingDefaults(config.temperature, config.top_p, config.top_k, config.max_new_tokens)


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities of consecutive emitted tokens, and the most likely alternatives at each."""

    logprobs: list[float]  # [tokens] the emitted token's
    top_ids: list[list[int]]  # [tokens][k] most likely token ids, most likely first
    top_logprobs: list[list[float]]  # [tokens][k] their logprobs

    def __len__(self) -> int:
        return len(self.logprobs)

    def head(self, num_tokens: int) -> TokenLogprobs:
        """The first ``num_tokens`` tokens' entries."""
        return TokenLogprobs(self.logprobs[:num_tokens], self.top_ids[:num_tokens], self.top_logprobs[:num_tokens])

    @staticmethod
    def join(parts: list[TokenLogprobs]) -> TokenLogprobs:
        return TokenLogprobs(
            [x for p in parts for x in p.logprobs],
            [x for p in parts for x in p.top_ids],
            [x for p in parts for x in p.top_logprobs],
        )
