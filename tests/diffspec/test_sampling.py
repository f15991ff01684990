"""The target distribution's filters and the logprobs reported from it, exactly."""

from __future__ import annotations

import math

import pytest
import torch

from diffspec.errors import InvalidRequest
from diffspec.sampling import LOGPROB_FLOOR, SamplingParams, target_logprobs, target_probs, token_logprobs

LOGITS = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])


@pytest.mark.parametrize(
    ("top_k", "top_p", "kept"),
    [
        (0, 1.0, 6),
        (3, 1.0, 3),  # top-k alone
        (1, 1.0, 1),
        (6, 1.0, 6),
        (10, 1.0, 6),  # more than the vocabulary = all
        (0, 0.7, 2),  # softmax: 0.64, 0.23, ... -> the first two reach 0.7
        (4, 0.7, 2),  # top-p over the top-k renormalised
        (2, 0.99, 2),  # top-k bounds what top-p keeps
    ],
)
def test_top_k_then_top_p_keep_the_most_likely_tokens(top_k, top_p, kept):
    probs = target_probs(LOGITS, SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k))
    assert int((probs > 0).sum()) == kept
    assert (probs[0, :kept] > 0).all()  # the most likely ones
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-6)
    want = torch.softmax(LOGITS[0, :kept], -1)  # renormalised over the kept tokens
    assert torch.allclose(probs[0, :kept], want)


def test_logprobs_are_the_sampled_distributions_and_the_models_when_greedy():
    sampled = SamplingParams(temperature=0.5, top_k=2, logprobs=3)
    out = token_logprobs(LOGITS.repeat(2, 1), [1, 4], sampled)
    assert torch.allclose(torch.tensor(out.logprobs[0]), target_probs(LOGITS, sampled)[0, 1].log())
    assert out.logprobs[1] == LOGPROB_FLOOR  # outside the top-k: the floor, never -inf
    assert [ids[:2] for ids in out.top_ids] == [[0, 1], [0, 1]]
    assert out.top_logprobs[0][2] == LOGPROB_FLOOR  # past the kept tokens, alternatives tie at the floor
    greedy = token_logprobs(LOGITS, [4], SamplingParams(logprobs=0))
    assert greedy.top_ids == [[]] and math.isclose(greedy.logprobs[0], float(torch.log_softmax(LOGITS, -1)[0, 4]), rel_tol=1e-6)
    assert torch.equal(target_logprobs(LOGITS, SamplingParams(top_k=1)), torch.log_softmax(LOGITS, -1))


@pytest.mark.parametrize(("fields", "says"), [({"top_k": -1}, "top_k must be >= 0"), ({"logprobs": 21}, "logprobs must be in")])
def test_bad_parameters_are_refused(fields, says):
    with pytest.raises(InvalidRequest, match=says):
        SamplingParams(**fields)


def test_samples_get_distinct_seeds_derived_from_the_requests():
    params = SamplingParams(temperature=1.0, seed=42)
    seeds = [params.for_sample(i).seed for i in range(4)]
    assert seeds[0] == 42 and len(set(seeds)) == 4 and all(0 <= s < 2**63 for s in seeds)
    assert SamplingParams(temperature=1.0).for_sample(3).seed is None
