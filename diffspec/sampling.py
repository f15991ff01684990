"""The target distribution sampling parameters define, and the log-probabilities reported.

The parameters themselves (``SamplingParams``, ``TokenLogprobs``) are torch-free, in
``diffspec/sampling_params.py``.

Temperature 0 means greedy (argmax). Above 0, logits are divided by the temperature, top-k keeps
the ``top_k`` most likely tokens, then top-p keeps the smallest set of the rest whose mass
reaches ``top_p`` (vLLM's order). Speculative acceptance and plain sampling both draw from exactly
this distribution, the same way (``inverse_cdf`` at the token index's uniform), which is what makes
speculation lossless, and its tokens a seeded Auto run's.

Log-probabilities (``logprobs``) are those of the distribution the token was drawn from: the
filtered, renormalised one above temperature 0 (a token it excludes reports ``LOGPROB_FLOOR``),
the model's own softmax at temperature 0 (greedy has no other distribution worth reporting).
They depend only on the target's logits at the token's position, so a token verified from a
draft tree reports what Auto would have reported for it.
"""

from __future__ import annotations

import torch

from diffspec.sampling_params import SamplingParams, TokenLogprobs

LOGPROB_FLOOR = -9999.0  # reported for tokens the filtered distribution excludes (JSON has no -inf)


def _filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., vocab] -> float32 logits / temperature with the tokens outside top-k and top-p at -inf."""
    # Shift before scaling: the largest logit becomes 0 and any temperature, however small, gives
    # finite values (a tiny temperature would otherwise overflow to inf - inf = NaN).
    logits = logits.float()
    scaled = (logits - logits.amax(-1, keepdim=True)) / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kept = scaled.topk(params.top_k, dim=-1).indices  # exactly k tokens, ties broken by index
        scaled = torch.full_like(scaled, float("-inf")).scatter(-1, kept, scaled.gather(-1, kept))
    if params.top_p >= 1.0:
        return scaled
    sorted_probs, order = torch.softmax(scaled, dim=-1).sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    drop = mass_before >= params.top_p
    drop[..., 0] = False  # the most likely token always stays (a top_p below float32's range would drop it)
    return scaled.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., vocab] float32 logits -> the distribution sampling draws from (temperature > 0)."""
    return torch.softmax(_filtered_logits(logits, params), dim=-1)


def target_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., vocab] logits -> the log-probabilities reported: the sampled distribution's above
    temperature 0, the model's softmax at 0."""
    if params.greedy:
        return torch.log_softmax(logits.float(), dim=-1)
    return torch.log_softmax(_filtered_logits(logits, params), dim=-1)


def token_logprobs(logits: torch.Tensor, tokens: list[int], params: SamplingParams) -> TokenLogprobs:
    """logits [len(tokens), vocab]: row i is the distribution ``tokens[i]`` was emitted from."""
    assert params.logprobs is not None
    logp = target_logprobs(logits, params).clamp_min(LOGPROB_FLOOR)
    chosen = logp.gather(-1, torch.tensor(tokens, device=logp.device).view(-1, 1)).squeeze(-1)
    top = logp.topk(params.logprobs, dim=-1)
    return TokenLogprobs(chosen.tolist(), top.indices.tolist(), top.values.tolist())


def is_distribution(probs: torch.Tensor) -> torch.Tensor:
    """[..., vocab] -> [...] bool: finite everywhere and with some mass (NaN logits give none)."""
    return torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1, dtype=torch.float64) > 0)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [n, vocab], uniforms [n] float64 in [0, 1) on the same device -> [n] int64: each row's token whose
    cumulative mass (float64) first passes its uniform times the row's total, never a token with no mass. No
    value is read back to the host."""
    cumulative = probs.double().cumsum(dim=-1)
    total = cumulative[:, -1:].contiguous()  # [n, 1]
    drawn = torch.searchsorted(cumulative, uniforms.unsqueeze(-1) * total, right=True)
    last_possible = torch.searchsorted(cumulative, total)  # where the total is reached: the last token with mass
    return torch.minimum(drawn, last_possible).squeeze(-1)
