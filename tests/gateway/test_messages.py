"""Gateway messages: request defaults, checks of the message itself, stats round trip with every field carried."""

from __future__ import annotations

import dataclasses

import pytest

from diffspec.errors import InvalidRequest
from diffspec.sampling_params import SamplingDefaults
from diffspec.settings import DiffSpecSettings
from diffspec.v1 import gateway_pb2
from draft_service.backend import DraftOptions
from gateway.messages import (
    chunk_from_proto,
    chunk_to_proto,
    generation_request,
    prompt_text,
    stats_from_proto,
    stats_to_proto,
)
from gateway.request import GenerationChunk, GenerationStats

DEFAULTS = DiffSpecSettings(policy="chain", tree_config="8:0.1:4", max_new_tokens=12)


def test_unset_fields_take_the_server_defaults():
    request = generation_request(gateway_pb2.GenerateRequest(text="x"), [0, 5], DEFAULTS)
    assert request.max_new_tokens == 12 and request.sampling.top_p == 1.0 and request.sampling.seed is None
    assert request.draft == DraftOptions("chain", "8:0.1:4", False)
    explicit = gateway_pb2.GenerateRequest(
        text="x", max_new_tokens=3, top_p=0.5, seed=0, policy="auto", temperature=0.7, stop=["\n"]
    )
    request = generation_request(explicit, [0, 5], DEFAULTS)
    assert request.max_new_tokens == 3 and request.sampling.top_p == 0.5 and request.sampling.seed == 0
    assert request.draft is None and request.stop_sequences == ("\n",) and request.sampling.temperature == 0.7
    stopping = generation_request(gateway_pb2.GenerateRequest(text="x", stop_token_ids=[7, 3, 7]), [0], DEFAULTS)
    assert stopping.stop_token_ids == {3, 7}


CHECKPOINT = SamplingDefaults(temperature=0.6, top_p=0.9, top_k=40)  # a generation_config.json's
NO_CHECKPOINT = SamplingDefaults()


@pytest.mark.parametrize(
    "fields, checkpoint, default_temperature, want",
    [
        ({}, NO_CHECKPOINT, 0.0, (0.0, 1.0, 0)),  # gRPC and the CLI: greedy
        ({}, NO_CHECKPOINT, 1.0, (1.0, 1.0, 0)),  # HTTP: OpenAI's temperature
        ({}, CHECKPOINT, 0.0, (0.6, 0.9, 40)),
        ({}, CHECKPOINT, 1.0, (0.6, 0.9, 40)),
        ({"temperature": 0.0}, CHECKPOINT, 0.0, (0.0, 0.9, 40)),  # an explicit 0 wins
        ({"top_p": 1.0, "top_k": 0}, CHECKPOINT, 1.0, (0.6, 1.0, 0)),
        ({"temperature": 1.2, "top_p": 0.5, "top_k": 3}, CHECKPOINT, 0.0, (1.2, 0.5, 3)),
        ({}, SamplingDefaults(top_p=0.8), 1.0, (1.0, 0.8, 0)),  # what the checkpoint leaves out: the front end's
    ],
)
def test_unset_sampling_fields_take_the_checkpoints_defaults_then_the_front_ends(
    fields, checkpoint, default_temperature, want
):
    message = gateway_pb2.GenerateRequest(text="x", **fields)
    sampling = generation_request(message, [0], DEFAULTS, True, checkpoint, default_temperature).sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == want


@pytest.mark.parametrize(
    "fields, checkpoint, max_context, prompt_tokens, want",
    [
        ({}, None, 0, 2, 12),  # the server's --max-new-tokens
        ({}, None, 30, 29, 12),  # the server's own default is not capped: past the context, the engine ends it
        ({}, 40, 0, 2, 40),
        ({}, 40, 4096, 2, 40),
        ({}, 40, 30, 2, 28),  # what the prompt leaves of the context, as vLLM's max_model_len - prompt
        ({}, 40, 30, 30, 1),  # a prompt that fills the context: the engine refuses the prompt
        ({"max_new_tokens": 3}, 40, 30, 2, 3),  # a request that sets it wins
        ({"max_new_tokens": 100}, 40, 30, 2, 100),  # and is the engine's to check
    ],
)
def test_unset_max_new_tokens_takes_the_checkpoints_within_the_context(
    fields, checkpoint, max_context, prompt_tokens, want
):
    message = gateway_pb2.GenerateRequest(text="x", **fields)
    defaults = SamplingDefaults(max_new_tokens=checkpoint)
    request = generation_request(message, [0] * prompt_tokens, DEFAULTS, True, defaults, max_context=max_context)
    assert request.max_new_tokens == want


@pytest.mark.parametrize(
    "fields, ids, message",
    [
        ({"stop": ["y" * 257]}, [0], "stop sequences"),
        ({"stop_token_ids": list(range(65))}, [0], "at most 64 stop token ids"),
        ({"policy": "auto", "tree_config": "64:abc:8"}, [0], "bad tree config"),  # checked with Auto too
        ({"n": 0}, [0], "n must be in"),
        ({"n": 17}, [0], "n must be in \\[1, 16\\]"),
        ({"top_k": -1}, [0], "top_k must be >= 0"),
        ({"logprobs": 21}, [0], "logprobs must be in"),
    ],
)
def test_malformed_messages_are_rejected_up_front(fields, ids, message):
    """What the message itself gets wrong; what the target could not serve is the engine's check
    (test_request_checks.py)."""
    with pytest.raises(InvalidRequest, match=message):
        generation_request(gateway_pb2.GenerateRequest(text="x", **fields), ids, DEFAULTS)


def test_n_is_bounded_by_the_concurrent_generations_and_sampling_fields_reach_the_request():
    two_at_once = DEFAULTS.model_copy(update={"max_sessions": 2})
    with pytest.raises(InvalidRequest, match="n must be in \\[1, 2\\]"):
        generation_request(gateway_pb2.GenerateRequest(text="x", n=3), [0], two_at_once)
    message = gateway_pb2.GenerateRequest(text="x", n=3, top_k=5, logprobs=0, temperature=1.0)
    request = generation_request(message, [0], DEFAULTS)
    assert (request.n, request.sampling.top_k, request.sampling.logprobs) == (3, 5, 0)
    assert generation_request(gateway_pb2.GenerateRequest(text="x"), [0], DEFAULTS).sampling.logprobs is None


def test_without_a_draft_a_request_naming_no_policy_is_auto():
    assert generation_request(gateway_pb2.GenerateRequest(text="x"), [0], DEFAULTS, draft_available=False).draft is None


def test_prompt_text_needs_a_prompt():
    assert prompt_text(gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[1]))) is None
    with pytest.raises(InvalidRequest, match="no prompt"):
        prompt_text(gateway_pb2.GenerateRequest())


def test_stats_round_trip_carries_every_field():
    stats = GenerationStats(
        prompt_tokens=7,
        new_tokens=30,
        steps=9,
        accepted_drafts=21,
        stop_depth_histogram=[1, 0, 3, 5],
        prefill_seconds=0.125,
        draft_seconds=0.5,
        verify_seconds=0.25,
        decode_seconds=1.5,
        finish_reason="eos",
        fell_back_to_auto=True,
        hazard=[0.1, 0.2],
        working_set_tokens=2048,
        working_set_updates=7,
    )
    assert {f.name for f in dataclasses.fields(GenerationStats)} <= set(
        gateway_pb2.GenerationStats.DESCRIPTOR.fields_by_name
    )
    back = stats_from_proto(gateway_pb2.GenerationStats.FromString(stats_to_proto(stats).SerializeToString()))
    assert back == stats and back.to_dict() == stats.to_dict()


def test_prefill_progress_crosses_the_wire_on_progress_only_chunks():
    progress = GenerationChunk([], "", prefill_progress=(2048, 8192))
    response = chunk_to_proto(progress)
    assert not response.HasField("stats") and list(response.token_ids) == [] and response.text == ""
    assert chunk_from_proto(response) == progress
    tokens = chunk_from_proto(chunk_to_proto(GenerationChunk([5, 6], "ab")))
    assert tokens.prefill_progress is None and not chunk_to_proto(tokens).HasField("prefill_progress")
