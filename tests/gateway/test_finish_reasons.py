"""finish_reason ``eos`` and ``context`` through the in-process engine, the gRPC gateway and the HTTP API.

The bundled model never ends a file with ``<|eos|>`` (its corpus joins files with ``# file:`` headers),
so the EOS case runs on a copy of it whose generation_config.json adds, beside ``<|eos|>``, an id the
model does emit greedily: as Llama-3.1 lists ``<|eot_id|>`` and ``<|eom_id|>`` there beside its
config.json's one. The context case runs on the bundled model with ``max_context`` a few tokens past
the prompt.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterator

import grpc
import httpx
import pytest

from diffspec.settings import BUNDLED_DRAFT, BUNDLED_TARGET, DiffSpecSettings
from diffspec.v1 import gateway_pb2_grpc
from draft_service.options import DraftOptions
from gateway.assembly import build_engine
from gateway.engine import SpeculativeEngine
from gateway.request import GenerationRequest
from tests.gateway.conftest import CODE_PROMPTS, assert_all_released, collect, generate
from tests.gateway.live_gateway import LiveGateway

PROMPT = CODE_PROMPTS[1]  # "class Stack: ... def push(self, item):" -> "\n        self.items.append(item)..."
NEW_TOKENS = 32
EOS_AT = 10  # the eos id is the first token the model emits at or after this position
CONTEXT_LEFT = 13  # max_context - prompt tokens
POLICIES = [None, DraftOptions("chain", "24:0.0:5"), DraftOptions("full", "24:0.0:5"),
            DraftOptions("online", "64:0.0:8", salience=True)]  # fmt: skip


def policy_id(options: DraftOptions | None) -> str:
    return "auto" if options is None else f"{options.policy}{'-salience' if options.salience else ''}"


def with_extra_eos(out_dir: Path, eos_id: int) -> Path:
    """The bundled target with ``eos_id`` added to generation_config.json's ``eos_token_id``."""
    out_dir.mkdir()
    for source in BUNDLED_TARGET.iterdir():
        if source.name == "model.safetensors":
            (out_dir / source.name).symlink_to(source)
        else:
            shutil.copy(source, out_dir / source.name)
    generation = json.loads((out_dir / "generation_config.json").read_text())
    generation["eos_token_id"] = [generation["eos_token_id"], eos_id]
    (out_dir / "generation_config.json").write_text(json.dumps(generation))
    return out_dir


def first_new_token_from(ids: list[int], position: int) -> int:
    """The index of the first token at or after ``position`` that does not occur before it."""
    return next(i for i in range(position, len(ids)) if ids[i] not in ids[:i])


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:
    return tokenizer(PROMPT)["input_ids"]


@pytest.fixture(scope="module")
def auto_ids(auto_reference) -> list[int]:
    """The bundled target's greedy continuation, without any extra eos id."""
    return auto_reference(PROMPT, NEW_TOKENS)


def engine_for(settings: DiffSpecSettings) -> SpeculativeEngine:
    return build_engine(settings.model_copy(update={"draft_model": BUNDLED_DRAFT}))


@pytest.fixture(scope="module")
def eos_engine(auto_ids, tmp_path_factory) -> Iterator[tuple[SpeculativeEngine, int]]:
    """(engine over the target with an extra eos id, how many tokens come before that id)."""
    eos_at = first_new_token_from(auto_ids, EOS_AT)
    target_dir = with_extra_eos(tmp_path_factory.mktemp("eos") / "tiny-code-eos", auto_ids[eos_at])
    engine = engine_for(DiffSpecSettings(base_model=target_dir, num_pages=256))
    assert engine.core.info.eos_token_ids == (1, auto_ids[eos_at])  # config.json's, then generation_config.json's
    yield engine, eos_at
    engine.close()


@pytest.fixture(scope="module")
def context_engine(prompt_ids) -> Iterator[SpeculativeEngine]:
    max_context = len(prompt_ids) + CONTEXT_LEFT
    engine = engine_for(DiffSpecSettings(base_model=BUNDLED_TARGET, num_pages=256, max_context=max_context))
    assert engine.core.info.max_context == max_context
    yield engine
    engine.close()


@pytest.mark.parametrize("options", POLICIES, ids=policy_id)
def test_eos_ends_the_stream_before_the_eos_token(eos_engine, auto_ids, prompt_ids, options):
    """Speculative steps accept paths past the eos id (the draft proposes it and what follows): the output
    still stops right before it, as Auto's does, and the eos token itself is not emitted."""
    engine, eos_at = eos_engine
    ids, text, stats = collect(engine, GenerationRequest(prompt_ids, NEW_TOKENS, draft=options))
    assert ids == auto_ids[:eos_at]
    assert stats.finish_reason == "eos" and stats.new_tokens == eos_at
    assert text == engine.tokenizer.decode(auto_ids[:eos_at])
    assert_all_released(engine)


@pytest.mark.parametrize("options", POLICIES, ids=policy_id)
def test_context_end_stops_the_stream_at_max_context(context_engine, auto_ids, prompt_ids, options):
    """max_new_tokens reaches past the context: the stream stops when prompt + output fill it, trees
    shrinking to fit the context left."""
    ids, _, stats = collect(context_engine, GenerationRequest(prompt_ids, NEW_TOKENS, draft=options))
    assert ids == auto_ids[:CONTEXT_LEFT]
    assert stats.finish_reason == "context" and stats.new_tokens == CONTEXT_LEFT
    assert stats.prompt_tokens + stats.new_tokens == context_engine.core.info.max_context
    assert_all_released(context_engine)


def test_a_prompt_one_short_of_the_context_gets_its_first_token_only(context_engine, prompt_ids, auto_ids):
    """The first token, sampled at prefill, is the last the context holds: no verification runs."""
    prompt = prompt_ids + auto_ids[: CONTEXT_LEFT - 1]
    ids, _, stats = collect(context_engine, GenerationRequest(prompt, NEW_TOKENS, draft=DraftOptions("full")))
    assert ids == auto_ids[CONTEXT_LEFT - 1 : CONTEXT_LEFT]
    assert stats.finish_reason == "context" and stats.new_tokens == 1 and stats.steps == 0
    assert_all_released(context_engine)


def test_an_eos_first_token_is_an_empty_completion(tmp_path, auto_ids, prompt_ids):
    """The prefill's token is the eos id: nothing is streamed, the stats say eos and no speed is made up."""
    engine = engine_for(DiffSpecSettings(base_model=with_extra_eos(tmp_path / "eos-first", auto_ids[0]), num_pages=64))
    try:
        ids, text, stats = collect(engine, GenerationRequest(prompt_ids, NEW_TOKENS, draft=DraftOptions("full")))
        assert ids == [] and text == ""
        assert stats.finish_reason == "eos" and stats.new_tokens == 0 and stats.steps == 0
        assert stats.decode_tokens_per_second == 0.0
        assert_all_released(engine)
    finally:
        engine.close()


@pytest.mark.parametrize(("fixture", "grpc_reason", "openai_reason"), [
    ("eos_engine", "eos", "stop"),
    ("context_engine", "context", "length"),
])  # fmt: skip
def test_the_gateway_reports_the_reason_on_grpc_and_http(request, fixture, grpc_reason, openai_reason, auto_ids):
    """gRPC streams the engine's reason; the OpenAI API maps eos to ``stop`` and context to ``length``."""
    engine = request.getfixturevalue(fixture)
    engine = engine[0] if isinstance(engine, tuple) else engine
    want = collect(engine, GenerationRequest(engine.tokenizer(PROMPT)["input_ids"], NEW_TOKENS))[0]
    gateway = LiveGateway(engine, DiffSpecSettings(policy="full"))
    try:
        with grpc.insecure_channel(gateway.address) as channel:
            ids, text, stats = generate(gateway_pb2_grpc.GatewayStub(channel), text=PROMPT, max_new_tokens=NEW_TOKENS,
                                        policy="full")  # fmt: skip
        assert ids == want == auto_ids[: len(want)] and stats.finish_reason == grpc_reason
        assert stats.new_tokens == len(want)
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0}
        completion = httpx.post(f"{gateway.http_base}/completions", json=body, timeout=60).json()
        (choice,) = completion["choices"]
        assert choice["text"] == text and choice["finish_reason"] == openai_reason
        assert completion["usage"]["completion_tokens"] == len(want)
    finally:
        gateway.stop()
    assert_all_released(engine)
