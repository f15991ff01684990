"""Prompts and chat messages to ids: one BOS, whether the template or the client rendered it."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from diffspec.errors import InvalidRequest
from gateway.prompt import encode_prompt, render_chat

# Llama-3.1's template in miniature: it renders bos_token itself, then one block per message.
TEMPLATE = (
    "{{- bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
    "{% if messages[0]['role'] == 'tool' %}{{ raise_exception('a conversation cannot open with a tool') }}{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x != y?"}]
RENDERED = "<system>Be brief.</system>\n<user>x != y?</user>\n<assistant>"


@pytest.fixture()
def tokenizer(tiny_target_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def test_chat_renders_the_template_with_one_bos(tokenizer):
    ids = render_chat(tokenizer, MESSAGES)
    bos = tokenizer.bos_token_id
    assert ids[0] == bos and ids.count(bos) == 1
    assert ids[1:] == tokenizer(RENDERED, add_special_tokens=False)["input_ids"]


def test_a_pre_rendered_prompt_keeps_its_one_bos(tokenizer):
    bos = tokenizer.bos_token_id
    assert tokenizer(tokenizer.bos_token + RENDERED)["input_ids"][:2] == [bos, bos]  # what the default does
    ids = encode_prompt(tokenizer, tokenizer.bos_token + RENDERED)
    assert ids == render_chat(tokenizer, MESSAGES)
    plain = encode_prompt(tokenizer, "def main():")
    assert plain == tokenizer("def main():")["input_ids"] and plain[0] == bos and plain.count(bos) == 1


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "messages is empty"),
        ([{"role": "user"}], r"messages\[0\] needs a string 'content'"),
        ([{"role": "robot", "content": "hi"}], r"messages\[0\] has role 'robot'"),
        ([{"role": "tool", "content": "{}"}], "the chat template refused these messages: a conversation cannot open"),
    ],
)
def test_bad_messages_are_invalid_requests(tokenizer, messages, message):
    with pytest.raises(InvalidRequest, match=message):
        render_chat(tokenizer, messages)


def test_a_model_without_a_chat_template_refuses_messages(tiny_target_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    assert not tokenizer.chat_template
    with pytest.raises(InvalidRequest, match="no chat template"):
        render_chat(tokenizer, MESSAGES)
