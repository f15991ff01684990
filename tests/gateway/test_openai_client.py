"""The official ``openai`` package against the HTTP API on loopback: the bundled tiny pair for completions
(tokens equal to the gRPC path's at temperature 0, streamed and whole, n, logprobs, stop, errors), and a
tiny Llama-3.1-layout checkpoint with Llama-3's chat template for chat (rendered once, one BOS)."""

from __future__ import annotations

from typing import Iterator

import openai
import pytest
from transformers import AutoTokenizer

from diffspec.client import GatewayClient
from diffspec.settings import DiffSpecSettings
from gateway.assembly import build_engine
from tests.conftest import write_random_llama
from tests.gateway.conftest import CODE_PROMPTS
from tests.gateway.live_gateway import LiveGateway
from tests.gateway.tiny_tokenizer import write_llama3_tokenizer

PROMPT = CODE_PROMPTS[0]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def chat_live(tmp_path_factory) -> Iterator[LiveGateway]:
    model_dir = write_random_llama(tmp_path_factory.mktemp("llama3-chat"), llama3_rope=True, tie_embeddings=False)
    write_llama3_tokenizer(model_dir)
    settings = DiffSpecSettings(base_model=model_dir, num_pages=64, dtype="float32")
    engine = build_engine(settings)
    gateway = LiveGateway(engine, settings)
    yield gateway
    gateway.stop()
    engine.close()


def client_of(gateway: LiveGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.http_base, api_key="-", max_retries=0, timeout=60)


def test_completions_equal_the_grpc_path_streamed_or_whole(live_gateway):
    client = client_of(live_gateway)
    with GatewayClient(live_gateway.address) as grpc_client:
        (want,) = grpc_client.complete(PROMPT, max_new_tokens=16)
    whole = client.completions.create(model="tiny-code", prompt=PROMPT, max_tokens=16, temperature=0,
                                      extra_body={"policy": "full", "tree_config": "16:0.0:4"})  # fmt: skip
    assert whole.choices[0].text == want.text and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 16 and whole.model_extra["diffspec"]["accepted_drafts"] > 0
    stream = client.completions.create(model="tiny-code", prompt=PROMPT, max_tokens=16, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == want.text


def test_n_samples_logprobs_and_stop(live_gateway):
    client = client_of(live_gateway)
    reply = client.completions.create(model="m", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=1, n=3, logprobs=2)
    assert sorted(c.index for c in reply.choices) == [0, 1, 2] and reply.usage.completion_tokens == 24
    for choice in reply.choices:
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 8
        assert all(lp <= 0 for lp in logprobs.token_logprobs) and all(len(top) <= 2 for top in logprobs.top_logprobs)
    with_logprobs = client.completions.create(model="m", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1,
                                              stream=True)  # fmt: skip
    pieces = [c.choices[0] for c in with_logprobs if c.choices and c.choices[0].logprobs]
    offsets = [offset for piece in pieces for offset in piece.logprobs.text_offset]
    assert len(offsets) == 6 and offsets == sorted(offsets) and offsets[0] == 0  # offsets into the choice's text
    streamed = client.completions.create(model="m", prompt=PROMPT, max_tokens=4, temperature=0, n=2, stream=True)
    texts = {0: "", 1: ""}
    for chunk in streamed:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts[0] == texts[1] != ""  # greedy samples agree
    full = client.completions.create(model="m", prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    stop = full.strip()[:3]
    stopped = client.completions.create(model="m", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop]).choices[0]
    assert stopped.finish_reason == "stop" and stop not in stopped.text


def test_stop_token_ids_end_a_choice_as_over_grpc(live_gateway):
    """vLLM's ``stop_token_ids`` extension: the choice ends before the first listed id, finish_reason stop."""
    with GatewayClient(live_gateway.address) as grpc_client:
        (full,) = grpc_client.complete(PROMPT, max_new_tokens=16, policy="full")
        stop_id = full.token_ids[6]
        (grpc_stopped,) = grpc_client.complete(PROMPT, max_new_tokens=16, policy="full", stop_token_ids=[stop_id])
    assert grpc_stopped.token_ids == full.token_ids[: full.token_ids.index(stop_id)]
    assert grpc_stopped.stats is not None and grpc_stopped.stats.finish_reason == "stop"
    reply = client_of(live_gateway).completions.create(model="m", prompt=PROMPT, max_tokens=16, temperature=0,
                                                       extra_body={"stop_token_ids": [stop_id], "policy": "full"})
    assert reply.choices[0].text == grpc_stopped.text and reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == len(grpc_stopped.token_ids)
    with pytest.raises(openai.BadRequestError, match="stop token ids out of the vocabulary"):
        client_of(live_gateway).completions.create(model="m", prompt=PROMPT, extra_body={"stop_token_ids": [10**9]})


def test_a_bad_request_raises_openais_error(live_gateway):
    with pytest.raises(openai.BadRequestError) as raised:
        client_of(live_gateway).completions.create(model="m", prompt=PROMPT, top_p=3.0)
    assert raised.value.status_code == 400 and "top_p" in raised.value.body["message"]


def test_chat_renders_the_template_with_one_bos(chat_live):
    client = client_of(chat_live)
    tokenizer = AutoTokenizer.from_pretrained(chat_live.engine.target.model_path)
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id
    chat = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=2)  # fmt: skip
    assert chat.usage.prompt_tokens == len(ids)  # the template's BOS and no second one
    content = chat.choices[0].logprobs.content
    assert chat.choices[0].message.role == "assistant" and len(content) == chat.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    pre_rendered = client.completions.create(model="m", prompt=rendered, max_tokens=4, temperature=0)
    assert pre_rendered.usage.prompt_tokens == len(ids) and pre_rendered.choices[0].text == chat.choices[0].message.content
    stream = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, temperature=0, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == chat.choices[0].message.content
