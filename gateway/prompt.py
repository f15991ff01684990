"""Prompt text and chat messages -> the target's token ids.

A chat template renders the BOS token itself (Llama-3.1's starts with ``{{- bos_token }}``), and
the tokenizer adds another unless told not to: so special tokens are added only to a text that
does not already start with BOS, whether a template rendered it or a client sent it pre-rendered.
"""

from __future__ import annotations

from typing import Any, Protocol

from jinja2 import TemplateError

from diffspec.errors import InvalidRequest

CHAT_ROLES = ("system", "user", "assistant", "tool")


class ChatTokenizer(Protocol):
    bos_token: str | None
    chat_template: str | None

    def __call__(self, text: str, add_special_tokens: bool = ...) -> Any: ...

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...


def encode_prompt(tokenizer: ChatTokenizer, text: str) -> list[int]:
    """Token ids of a prompt; BOS is added only when the text does not begin with it already."""
    bos = tokenizer.bos_token
    return list(tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"])


def render_chat(tokenizer: ChatTokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The checkpoint's chat template over ``messages`` ({"role", "content"} each), opened for the
    assistant's reply, as token ids with one BOS."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("this model has no chat template: send a prompt rather than messages")
    if not messages:
        raise InvalidRequest("messages is empty")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise InvalidRequest(f"messages[{i}] needs a string 'content'")
        if message.get("role") not in CHAT_ROLES:
            raise InvalidRequest(f"messages[{i}] has role {message.get('role')!r}; expected one of {list(CHAT_ROLES)}")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError as bad:  # templates raise on conversations they do not support
        raise InvalidRequest(f"the chat template refused these messages: {bad}") from None
    return encode_prompt(tokenizer, text)
