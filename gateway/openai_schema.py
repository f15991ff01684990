"""OpenAI's request and response shapes for ``/v1/completions`` and ``/v1/chat/completions``.

A request becomes the gateway's ``GenerateRequest`` message, carrying only the fields it sets, so HTTP
requests pass exactly the checks and defaults of gRPC ones (``gateway/messages.py``: the checkpoint's
generation_config.json sampling defaults included), but for OpenAI's temperature 1 in place of greedy.
OpenAI fields this server cannot honour (penalties, ``echo``, ``best_of``, ``suffix``) are refused with
a 400 rather than ignored; unknown fields are refused too. DiffSpec's own options (``policy``, ``tree_config``, ``salience``) and
vLLM's ``top_k`` and ``stop_token_ids`` are extra body fields (``extra_body`` in the ``openai`` client).

Logprobs: completions ask with ``logprobs: k`` and get OpenAI's legacy object (``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``); chat asks with ``logprobs: true`` and
``top_logprobs: k`` and gets ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``.
A token's text is its own decoding.
"""

from __future__ import annotations

import itertools
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from diffspec.errors import InvalidRequest
from diffspec.sampling_params import MAX_LOGPROBS, TokenLogprobs
from diffspec.v1 import gateway_pb2
from gateway.messages import MAX_SAMPLES
from gateway.request import GenerationStats

INT32_MAX = 2**31 - 1
DEFAULT_TEMPERATURE = 1.0  # OpenAI's, where neither the request nor the checkpoint's generation_config.json sets one
INT64 = 2**63
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


class StreamOptions(BaseModel):
    include_usage: bool = False  # one more chunk before [DONE]: no choices, the usage


class SamplingFields(BaseModel):
    """What completions and chat share: sampling, stop, streaming, and DiffSpec's options."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # echoed; the server serves one model
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)  # unset = the checkpoint's, else the server's
    # unset sampling fields: the checkpoint's generation_config.json value, else temperature 1, top_p 1, top_k all
    temperature: float | None = None  # 0 = greedy
    top_p: float | None = None
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int = Field(1, ge=1, le=MAX_SAMPLES)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)  # -1 or 0 = all tokens (vLLM's -1)
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=INT64)]] | None = None  # vLLM's: a generated id among these ends the choice, unemitted
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # DiffSpec's extension fields ("" / None = the server's default)
    policy: str = ""  # auto, chain, uniform<K>, full, online
    tree_config: str = ""  # total_tokens:threshold:depth
    salience: bool | None = None

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> SamplingFields:
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported")
        return self

    def num_logprobs(self) -> int | None:
        """Alternatives to report per token; None = no logprobs."""
        raise NotImplementedError

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def generate_message(self, max_tokens: int | None) -> gateway_pb2.GenerateRequest:
        """The gRPC request with these fields (the prompt travels separately, as token ids)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        message = gateway_pb2.GenerateRequest(
            stop=stops,
            stop_token_ids=self.stop_token_ids or [],
            policy=self.policy,
            tree_config=self.tree_config,
            n=self.n,
        )
        optional = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": None if self.top_k is None else max(self.top_k, 0),
            "logprobs": self.num_logprobs(),
            "max_new_tokens": max_tokens,
            "seed": self.seed,
            "salience": self.salience,
        }
        for name, value in optional.items():
            if value is not None:  # unset stays unset: the server's defaults apply (gateway/messages.py)
                setattr(message, name, value)
        return message


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # the token's and this many alternatives
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if self.echo or self.best_of not in (None, 1) or self.suffix:
            raise ValueError("echo, best_of and suffix are not supported")
        if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int):
            if len(self.prompt) != 1:
                raise ValueError("one prompt per request: send a string or a list of token ids")
        return self

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompt_value(self) -> str | list[int]:
        """The one prompt: its text, or its token ids."""
        if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int):
            return self.prompt[0]  # type: ignore[return-value]
        return self.prompt  # type: ignore[return-value]


class ChatRequest(SamplingFields):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)  # the newer name of max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # alternatives per token, with logprobs

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat_messages(self) -> list[dict[str, Any]]:
        """The messages with OpenAI's content parts ([{"type": "text", "text": ...}]) joined into one string."""
        return [{**m, "content": _content_text(m.get("content"))} for m in self.messages]


def _content_text(content: Any) -> Any:
    if not isinstance(content, list):
        return content  # render_chat checks that it is a string
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        raise InvalidRequest("only text content parts are supported")
    return "".join(p["text"] for p in content)


def finish_reason(stats: GenerationStats) -> str:
    """eos / stop -> "stop"; length / context -> "length"."""
    return FINISH_REASONS.get(stats.finish_reason, "stop")


def usage(samples: list[GenerationStats]) -> dict[str, int]:
    """The prompt once, the completions of every sample."""
    prompt, completion = samples[0].prompt_tokens, sum(stats.new_tokens for stats in samples)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_logprobs(
    logprobs: TokenLogprobs, tokens: list[str], alternatives: list[list[str]], offset: int
) -> dict[str, Any]:
    """OpenAI's legacy completions object; ``offset``: where the first token starts in the choice's text."""
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset))[: len(tokens)]
    return {
        "tokens": tokens,
        "token_logprobs": logprobs.logprobs,
        "top_logprobs": [dict(zip(names, values)) for names, values in zip(alternatives, logprobs.top_logprobs)],
        "text_offset": offsets,
    }


def chat_logprobs(logprobs: TokenLogprobs, tokens: list[str], alternatives: list[list[str]]) -> dict[str, Any]:
    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp in zip(names, values)]}
            for token, logprob, names, values in zip(tokens, logprobs.logprobs, alternatives, logprobs.top_logprobs)
        ]
    }


def choice(
    kind: Literal["completion", "chat", "chat_delta"],
    text: str,
    finish: str | None,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One choice: ``text`` for completions, ``message`` for a chat reply, ``delta`` for a chat chunk."""
    body: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish}
    if kind == "completion":
        body["text"] = text
    elif kind == "chat":
        body["message"] = {"role": "assistant", "content": text}
    else:
        body["delta"] = {"content": text} if text else {}
    return body


def error_body(message: str, kind: str, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
