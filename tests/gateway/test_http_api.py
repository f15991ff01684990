"""The OpenAI-compatible HTTP API over the bundled tiny pair on the CPU, through httpx: most tests
in process (ASGI transport, no port), the disconnect test against uvicorn on a loopback port."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Iterator

import grpc
import httpx
import pytest

from diffspec.errors import (
    CheckpointError,
    DeadlineExceeded,
    InvalidRequest,
    KVPoolExhausted,
    PeerUnavailable,
    ResourceExhausted,
)
from diffspec.metrics import ServingMetrics
from diffspec.serving import Loading
from diffspec.settings import DiffSpecSettings
from diffspec.v1 import gateway_pb2_grpc
from gateway.assembly import build_engine
from gateway.engine import SpeculativeEngine
from gateway.http_api import HttpServer, create_app, status_of
from gateway.prompt import encode_prompt
from gateway.request import GenerationRequest
from tests.gateway.conftest import CODE_PROMPTS, assert_all_released, collect, generate
from tests.gateway.servers import ServerProcess

PROMPT = CODE_PROMPTS[2]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def settings() -> DiffSpecSettings:
    return DiffSpecSettings(num_pages=256, max_sessions=4, policy="auto")


@pytest.fixture(scope="module")
def engine(settings) -> Iterator[SpeculativeEngine]:
    loaded = build_engine(settings)
    assert loaded.draft is not None  # the bundled head: speculative policies are served
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def app(engine, settings):
    loading: Loading[SpeculativeEngine] = Loading("the gateway's engine")
    loading.set(engine)
    return create_app(loading, settings, ServingMetrics())


@pytest.fixture(scope="module")
def auto_text(engine) -> str:
    """The in-process Auto output for PROMPT, greedy."""
    request = GenerationRequest(encode_prompt(engine.tokenizer, PROMPT), NEW_TOKENS)
    return collect(engine, request)[1]


def call(app, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
            return await client.request(method, path, json=body)

    return asyncio.run(go())


def events(response: httpx.Response) -> list[Any]:
    """The SSE stream's data payloads, parsed; the last must be [DONE]."""
    lines = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def greedy(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny-code", "max_tokens": NEW_TOKENS, "temperature": 0, **fields}


def test_completion_greedy_equals_the_engine_and_token_ids_prompts_too(app, engine, auto_text):
    reply = call(app, "POST", "/v1/completions", greedy(prompt=PROMPT))
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == auto_text
    assert body["choices"][0]["finish_reason"] == "length"
    prompt_ids = encode_prompt(engine.tokenizer, PROMPT)
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": NEW_TOKENS,
        "total_tokens": len(prompt_ids) + NEW_TOKENS,
    }
    by_ids = call(app, "POST", "/v1/completions", greedy(prompt=prompt_ids)).json()
    assert by_ids["choices"][0]["text"] == auto_text


def test_streamed_chunks_concatenate_to_the_whole_text(app, auto_text):
    reply = call(app, "POST", "/v1/completions", greedy(prompt=PROMPT, stream=True, stream_options={"include_usage": True}))
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
    chunks = events(reply)
    *texts, usage = chunks
    assert "".join(c["choices"][0]["text"] for c in texts) == auto_text
    assert [c["choices"][0]["finish_reason"] for c in texts][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in texts[:-1])
    assert len({c["id"] for c in chunks}) == 1
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == NEW_TOKENS


def test_speculative_policy_from_the_extra_body_reaches_the_engine(app, auto_text):
    body = call(app, "POST", "/v1/completions", greedy(prompt=PROMPT, policy="chain", tree_config="8:0.0:4")).json()
    assert body["choices"][0]["text"] == auto_text  # lossless at temperature 0
    stats = body["diffspec"]
    assert stats["steps"] > 0 and stats["new_tokens"] == NEW_TOKENS
    assert stats["accepted_drafts"] > 0 and sum(stats["stop_depth_histogram"]) == stats["steps"]
    assert stats["mean_accepted_length"] == round((stats["accepted_drafts"] + stats["steps"]) / stats["steps"], 4)
    assert len(stats["stop_depth_histogram"]) <= 5  # a chain of depth 4 accepts at most 4 drafts per step
    auto = call(app, "POST", "/v1/completions", greedy(prompt=PROMPT, policy="auto")).json()["diffspec"]
    assert auto["accepted_drafts"] == 0 and auto["steps"] == NEW_TOKENS - 1


def test_stop_string_ends_with_finish_reason_stop(app, auto_text):
    stop = auto_text[5:9]
    body = call(app, "POST", "/v1/completions", greedy(prompt=PROMPT, stop=stop)).json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert stop not in body["choices"][0]["text"] and auto_text.startswith(body["choices"][0]["text"])


def test_chat_without_a_chat_template_is_a_clear_400(app, engine):
    assert engine.tokenizer.chat_template is None  # the bundled tokenizer has none
    for stream in (False, True):
        reply = call(app, "POST", "/v1/chat/completions", greedy(messages=[{"role": "user", "content": "hi"}], stream=stream))
        assert reply.status_code == 400
        assert reply.json()["error"] == {
            "message": "this model has no chat template: send a prompt rather than messages",
            "type": "invalid_request_error",
            "param": None,
            "code": 400,
        }


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"prompt": ""}, "the prompt is empty"),
        ({"prompt": [10**9]}, "token ids out of the vocabulary"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1"),
        ({"prompt": "x", "temperature": -1}, "temperature must be finite and >= 0"),
        ({"prompt": "x", "top_p": 0}, "top_p must be in (0, 1]"),
        ({"prompt": "x", "policy": "bogus"}, "bogus"),
        ({"prompt": "x", "n": 17}, "n: Input should be less than or equal to 16"),
        ({"prompt": "x", "logprobs": 21}, "logprobs: Input should be less than or equal to 20"),
        ({"prompt": "x", "top_k": -2}, "top_k: Input should be greater than or equal to -1"),
        ({"prompt": "x", "frobnicate": 1}, "frobnicate: Extra inputs are not permitted"),
        ({"prompt": ["a", "b"]}, "one prompt per request"),
        ({}, "prompt: Field required"),
    ],
)
def test_bad_input_is_a_400_in_openai_error_shape(app, body, says):
    reply = call(app, "POST", "/v1/completions", body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert says in error["message"] and error["type"] == "invalid_request_error"


def test_models_health_ready_and_metrics(app, engine):
    models = call(app, "GET", "/v1/models").json()
    assert models["object"] == "list" and [m["object"] for m in models["data"]] == ["model"]
    assert models["data"][0]["max_model_len"] == engine.core.info.max_context
    assert call(app, "GET", "/health").json() == {"status": "ok"}
    assert call(app, "GET", "/ready").status_code == 200
    assert "diffspec_active_generations" in call(app, "GET", "/metrics").text
    assert call(app, "GET", "/v1/nothing").json()["error"]["code"] == 404


def test_a_loading_engine_is_503(settings):
    app = create_app(Loading("the gateway's engine"), settings, ServingMetrics())
    assert call(app, "GET", "/ready").status_code == 503
    reply = call(app, "POST", "/v1/completions", greedy(prompt=PROMPT))
    assert reply.status_code == 503
    assert reply.json()["error"]["message"] == "the gateway's engine is still loading"


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (InvalidRequest("x"), 400),
        (KVPoolExhausted("x"), 429),
        (ResourceExhausted("x"), 429),
        (PeerUnavailable("x"), 503),
        (DeadlineExceeded("x"), 504),
        (CheckpointError("x"), 500),
    ],
)
def test_error_statuses(error, status):
    assert status_of(error)[0] == status


def test_a_client_that_disconnects_mid_stream_frees_every_page(engine, settings):
    metrics = ServingMetrics()
    loading: Loading[SpeculativeEngine] = Loading("the gateway's engine")
    loading.set(engine)

    async def go() -> None:
        server = HttpServer(create_app(loading, settings, metrics), "127.0.0.1:0", grace_seconds=1.0)
        address = await server.start()
        try:
            async with httpx.AsyncClient(base_url=f"http://{address}", timeout=120) as client:
                body = greedy(prompt=PROMPT, max_tokens=2000, stream=True)
                async with client.stream("POST", "/v1/completions", json=body) as reply:
                    assert reply.status_code == 200
                    texts = 0
                    async for line in reply.aiter_lines():
                        texts += line.startswith("data: ")
                        if texts == 4:
                            break
                    info = engine.target.info()
                    assert info.num_free_pages < info.num_pages  # the request holds pages while it streams
            await asyncio.to_thread(assert_all_released, engine)
        finally:
            await server.stop()

    asyncio.run(go())
    assert metrics.registry.get_sample_value("diffspec_active_generations") == 0
    assert metrics.registry.get_sample_value("diffspec_generated_tokens_total") == 0  # aborted, never finished


def test_serve_all_answers_http_beside_grpc_with_the_same_tokens(tmp_path, draft_head_dir):
    server = ServerProcess("all", tmp_path, "--http-listen", "127.0.0.1:0", env={"DIFFSPEC_DRAFT_MODEL": str(draft_head_dir)})
    try:
        line = server.process.stdout.readline()
        assert "OpenAI-compatible HTTP API on http://" in line, line
        base_url = line.split()[-1]
        server.wait_serving()
        with grpc.insecure_channel(server.address) as channel:
            ids, grpc_text, _ = generate(
                gateway_pb2_grpc.GatewayStub(channel), text=PROMPT, max_new_tokens=NEW_TOKENS, policy="auto"
            )
        with httpx.Client(base_url=base_url, timeout=60) as client:
            assert client.get("/models").status_code == 200
            body = client.post("/completions", json=greedy(prompt=PROMPT, policy="full")).json()
        assert body["choices"][0]["text"] == grpc_text and body["usage"]["completion_tokens"] == len(ids)
    finally:
        assert server.stop() == 0


def test_a_token_guards_every_route_but_the_probes(engine):
    loading: Loading[SpeculativeEngine] = Loading("the gateway's engine")
    loading.set(engine)
    app = create_app(loading, DiffSpecSettings(num_pages=256, auth_token="s3cret"), ServingMetrics())

    async def get(path: str, token: str | None) -> httpx.Response:
        headers = {"authorization": f"Bearer {token}"} if token is not None else {}
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get(path, headers=headers)

    assert asyncio.run(get("/v1/models", None)).status_code == 401
    assert asyncio.run(get("/v1/models", "wrong")).json()["error"]["type"] == "authentication_error"
    assert asyncio.run(get("/v1/models", "s3cret")).status_code == 200
    assert asyncio.run(get("/health", None)).status_code == 200


def test_top_k_one_samples_the_greedy_tokens(app, auto_text):
    body = {"prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 1.5, "top_k": 1, "seed": 3}
    for policy in ("auto", "full"):
        assert call(app, "POST", "/v1/completions", {**body, "policy": policy}).json()["choices"][0]["text"] == auto_text
