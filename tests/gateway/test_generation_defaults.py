"""A checkpoint's generation_config.json sampling defaults on every front end (vLLM's ``--generation-config
auto``): a request that leaves temperature, top_p or top_k unset gets the checkpoint's value, and one that
leaves max_new_tokens unset the checkpoint's within the context its prompt leaves, over gRPC (through the
Python client), HTTP completions and chat (through the ``openai`` package), and ``diffspec generate`` in
process or through a gateway; a field the request sets wins, an explicit 0 included; ``--generation-config
none`` turns them off. Checked on the sampling and length each request reaches the engine with, on a tiny
checkpoint in Llama-3.1-8B-Instruct's layout whose generation_config.json samples."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterator

import openai
import pytest

from cli.main import main
from diffspec.client import GatewayClient
from diffspec.sampling_params import SamplingDefaults
from diffspec.settings import BUNDLED_TARGET, DiffSpecSettings
from gateway.assembly import build_engine, sampling_defaults
from gateway.engine_core import EngineCore
from tests.conftest import write_random_llama
from tests.gateway.live_gateway import LiveGateway
from tests.gateway.tiny_tokenizer import write_llama3_tokenizer

# Llama-3.1-8B-Instruct's generation_config.json (its ids shrunk to the tiny vocabulary), with a top_k and a
# max_new_tokens added
GENERATION_CONFIG = {"bos_token_id": 0, "do_sample": True, "eos_token_id": [1, 2], "temperature": 0.6, "top_p": 0.9,
                     "top_k": 7, "max_new_tokens": 40, "transformers_version": "4.42.3"}  # fmt: skip
CHECKPOINT = (0.6, 0.9, 7)  # (temperature, top_p, top_k)
CHECKPOINT_MAX_NEW_TOKENS = 40
MAX_CONTEXT = 64  # the live gateway's: a prompt of 60 tokens leaves 4 of the checkpoint's 40
PROMPT = "Say hi."
LONG_PROMPT = [5] * 60
Sampled = tuple[float, float, int]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    model_dir = write_random_llama(tmp_path_factory.mktemp("sampling-defaults"), llama3_rope=True, tie_embeddings=False)
    write_llama3_tokenizer(model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return model_dir


@pytest.fixture(scope="module")
def live(model_dir) -> Iterator[LiveGateway]:
    settings = DiffSpecSettings(base_model=model_dir, num_pages=64, dtype="float32", max_context=MAX_CONTEXT)
    engine = build_engine(settings)
    gateway = LiveGateway(engine, settings)
    yield gateway
    gateway.stop()
    engine.close()


@pytest.fixture
def submitted(monkeypatch) -> list[Sampled]:
    """(temperature, top_p, top_k) of every request any engine is handed during the test."""
    seen: list[Sampled] = []
    submit = EngineCore.submit

    def recording(core, request_id, request, sink, deadline=None):  # noqa: ANN001, ANN202
        seen.append((request.sampling.temperature, request.sampling.top_p, request.sampling.top_k))
        submit(core, request_id, request, sink, deadline)

    monkeypatch.setattr(EngineCore, "submit", recording)
    return seen


@pytest.fixture
def lengths(monkeypatch) -> list[tuple[int, int]]:
    """(prompt tokens, max_new_tokens) of every request any engine is handed during the test."""
    seen: list[tuple[int, int]] = []
    submit = EngineCore.submit

    def recording(core, request_id, request, sink, deadline=None):  # noqa: ANN001, ANN202
        seen.append((len(request.prompt_ids), request.max_new_tokens))
        submit(core, request_id, request, sink, deadline)

    monkeypatch.setattr(EngineCore, "submit", recording)
    return seen


def test_the_settings_choose_whether_the_checkpoint_gives_defaults(model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="gateway.assembly"):
        want = SamplingDefaults(*CHECKPOINT, max_new_tokens=CHECKPOINT_MAX_NEW_TOKENS)
        assert sampling_defaults(DiffSpecSettings(base_model=model_dir)) == want
    (line,) = caplog.messages
    assert "temperature=0.6, top_p=0.9, top_k=7, max_new_tokens=40" in line and "--generation-config none" in line
    caplog.clear()
    assert sampling_defaults(DiffSpecSettings(base_model=model_dir, generation_config="none")) == SamplingDefaults()
    assert sampling_defaults(DiffSpecSettings(base_model=BUNDLED_TARGET)) == SamplingDefaults()  # do_sample false
    assert not caplog.messages


@pytest.mark.parametrize(
    "options, want",
    [
        ({}, CHECKPOINT),
        ({"temperature": 0.0}, (0.0, 0.9, 7)),
        ({"temperature": 1.0, "top_p": 1.0, "top_k": 0}, (1.0, 1.0, 0)),
    ],
)
def test_grpc(live, submitted, options, want):
    with GatewayClient(live.address) as client:
        client.complete(PROMPT, max_new_tokens=2, **options)
    assert submitted == [want]


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize(
    "fields, want",
    [
        ({}, CHECKPOINT),
        ({"temperature": 0}, (0.0, 0.9, 7)),
        ({"top_p": 0.5, "extra_body": {"top_k": -1}}, (0.6, 0.5, 0)),  # vLLM's -1: all tokens
    ],
)
def test_http(live, submitted, route, fields, want):
    client = openai.OpenAI(base_url=live.http_base, api_key="-", max_retries=0, timeout=60)
    if route == "completions":
        client.completions.create(model="m", prompt=PROMPT, max_tokens=2, **fields)
    else:
        messages = [{"role": "user", "content": PROMPT}]
        client.chat.completions.create(model="m", messages=messages, max_tokens=2, **fields)
    assert submitted == [want]


@pytest.mark.parametrize(
    "flags, want",
    [
        ([], CHECKPOINT),
        (["--temperature", "0", "--top-k", "0"], (0.0, 0.9, 0)),
        (["--generation-config", "none"], (0.0, 1.0, 0)),
    ],
)
def test_generate_in_process(model_dir, submitted, capsys, flags, want):
    args = ["generate", "--prompt", PROMPT, "--max-new-tokens", "2", "--json", "--base-model", str(model_dir),
            "--num-pages", "64", "--dtype", "float32", *flags]  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err
    assert submitted == [want]


def test_generate_through_a_gateway(live, submitted, capsys):
    assert main(["generate", "--gateway", live.address, "--prompt", PROMPT, "--max-new-tokens", "2", "--json"]) == 0
    assert main(["generate", "--gateway", live.address, "--prompt", PROMPT, "--max-new-tokens", "2", "--json",
                 "--top-p", "1"]) == 0  # fmt: skip
    assert submitted == [CHECKPOINT, (0.6, 1.0, 7)]


def test_max_new_tokens_over_grpc(live, lengths):
    with GatewayClient(live.address) as client:
        client.complete(PROMPT)
        client.complete(PROMPT, max_new_tokens=2)
        client.complete(LONG_PROMPT)  # the checkpoint's 40, capped at the 4 the context leaves
        client.complete(LONG_PROMPT, max_new_tokens=3)
    prompt_tokens = lengths[0][0]
    assert prompt_tokens + CHECKPOINT_MAX_NEW_TOKENS <= MAX_CONTEXT
    assert lengths == [(prompt_tokens, 40), (prompt_tokens, 2), (60, 4), (60, 3)]


def test_max_new_tokens_over_http(live, lengths):
    client = openai.OpenAI(base_url=live.http_base, api_key="-", max_retries=0, timeout=60)
    client.completions.create(model="m", prompt=PROMPT)
    client.completions.create(model="m", prompt=PROMPT, max_tokens=2)
    client.completions.create(model="m", prompt=LONG_PROMPT)
    messages = [{"role": "user", "content": PROMPT}]
    client.chat.completions.create(model="m", messages=messages)
    client.chat.completions.create(model="m", messages=messages, max_tokens=2)
    client.chat.completions.create(model="m", messages=messages, max_completion_tokens=3)
    chat_tokens = lengths[3][0]  # the chat template's tokens and the message's
    assert [n for _, n in lengths] == [40, 2, 4, min(40, MAX_CONTEXT - chat_tokens), 2, 3]


@pytest.mark.parametrize(
    "flags, want",
    [
        ([], CHECKPOINT_MAX_NEW_TOKENS),
        (["--max-new-tokens", "2"], 2),
        (["--generation-config", "none"], DiffSpecSettings().max_new_tokens),
    ],
)
def test_max_new_tokens_in_process(model_dir, lengths, capsys, flags, want):
    args = ["generate", "--prompt", PROMPT, "--json", "--base-model", str(model_dir), "--num-pages", "64",
            "--dtype", "float32", *flags]  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err
    assert [n for _, n in lengths] == [want]


def test_max_new_tokens_in_process_within_the_context(model_dir, lengths, capsys):
    args = ["generate", "--prompt", PROMPT, "--json", "--base-model", str(model_dir), "--num-pages", "64",
            "--dtype", "float32", "--max-context", "32"]  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err
    ((prompt_tokens, max_new_tokens),) = lengths
    assert max_new_tokens == 32 - prompt_tokens < CHECKPOINT_MAX_NEW_TOKENS


def test_max_new_tokens_through_a_gateway(live, lengths, capsys):
    assert main(["generate", "--gateway", live.address, "--prompt", PROMPT, "--json"]) == 0
    assert main(["generate", "--gateway", live.address, "--prompt", PROMPT, "--json", "--max-new-tokens", "2"]) == 0
    assert [n for _, n in lengths] == [CHECKPOINT_MAX_NEW_TOKENS, 2]
