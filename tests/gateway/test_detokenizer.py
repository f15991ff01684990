"""Streamed text equals a full decode on byte-level BPE, with either decode stream, in O(1) per token.

The tokenizer is the bundled one loaded with ``clean_up_tokenization_spaces=True``, as Llama-3.1's
tokenizer config has it: transformers 4.x then corrupts ``tokenizer.decode`` (``x != y`` ->
``x!= y``), transformers 5.x ignores the flag for BPE. Run under both to check both.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

import gateway.detokenizer as detokenizer_module
from gateway.detokenizer import IncrementalDetokenizer, OffsetDecodeStream, window_decoder

TEXTS = [
    "x != y",
    "a = 'social'",
    "don't , stop . here ?",
    "héllo 世界 🎉 naïve café — ok",
    "def f(x):\n    return {'k': [x , x]}  # 😀😀\n",
    "日本語のテキストと emoji 👩‍💻 mixed",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    return AutoTokenizer.from_pretrained(tiny_target_dir, clean_up_tokenization_spaces=True)


@pytest.fixture(params=["DecodeStream", "OffsetDecodeStream"])
def stream_kind(request, monkeypatch) -> str:
    if request.param == "DecodeStream" and detokenizer_module.DecodeStream is None:
        pytest.skip("tokenizers < 0.21 has no DecodeStream; OffsetDecodeStream serves instead")
    if request.param == "OffsetDecodeStream":
        monkeypatch.setattr(detokenizer_module, "DecodeStream", None)
    return request.param


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stream(tokenizer, ids: list[int], stops: tuple[str, ...] = ()) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, stops)
    pieces = [detok.push(i) for i in ids]
    return pieces + [detok.flush()], detok


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_the_text(tokenizer, stream_kind, text):
    ids = encode(tokenizer, text)
    pieces, _ = stream(tokenizer, ids)
    assert "".join(pieces) == text
    assert "".join(pieces) == window_decoder(tokenizer)(ids)
    assert not any("\ufffd" in p for p in pieces)  # no piece ends inside a character


def test_multibyte_characters_split_over_tokens_are_released_whole(tokenizer, stream_kind):
    ids = encode(tokenizer, "🎉")
    assert len(ids) > 1  # byte-level BPE spells the emoji over several byte tokens
    pieces, _ = stream(tokenizer, ids)
    assert pieces[:-2] == [""] * (len(ids) - 1) and pieces[-2] == "🎉"


def test_a_character_cut_by_the_length_limit_flushes_as_a_full_decode_does(tokenizer, stream_kind):
    ids = encode(tokenizer, "ok 🎉")[:-1]
    pieces, _ = stream(tokenizer, ids)
    assert "".join(pieces) == window_decoder(tokenizer)(ids)
    assert "".join(pieces).startswith("ok ") and pieces[-1].endswith("\ufffd")


def test_special_tokens_are_skipped(tokenizer, stream_kind):
    ids = [tokenizer.bos_token_id, *encode(tokenizer, "a b"), tokenizer.eos_token_id]
    pieces, _ = stream(tokenizer, ids)
    assert "".join(pieces) == "a b" and pieces[0] == ""


@pytest.mark.parametrize(
    ("text", "stop", "released"),
    [
        ("x != y and more", "!=", "x "),  # a stop spread over tokens
        ("return 'social'", "'s", "return "),
        ("abc 世界 def", "界 d", "abc 世"),  # a stop that begins with a multibyte character
        ("stop at once", "stop", ""),
        ("no stop here", "zzz", "no stop here"),  # the held tail is released by flush
    ],
)
def test_stop_sequences(tokenizer, stream_kind, text, stop, released):
    pieces, detok = stream(tokenizer, encode(tokenizer, text), (stop,))
    assert "".join(pieces) == released
    assert detok.stopped == (stop in text)


def test_held_tail_never_shows_a_stop_prefix_too_early(tokenizer, stream_kind):
    ids = encode(tokenizer, "a = b != c")
    detok = IncrementalDetokenizer(tokenizer, ("!= d",))
    released = ""
    for i in ids:
        released += detok.push(i)
        assert not released.endswith("!") and not released.endswith("!=")  # could still become the stop
    assert released + detok.flush() == "a = b != c" and not detok.stopped


def test_the_decode_stream_never_decodes_the_whole_output(tokenizer):
    """O(1) per token: the window decoded at each step stays a few tokens long."""
    decoded_lengths: list[int] = []
    decode = window_decoder(tokenizer)

    def counting_decode(ids: list[int]) -> str:
        decoded_lengths.append(len(ids))
        return decode(ids)

    ids = encode(tokenizer, " ".join(TEXTS) * 40)
    offsets = OffsetDecodeStream(counting_decode)
    text = "".join(piece for i in ids if (piece := offsets.step(i)) is not None)
    assert text == decode(ids) and len(ids) > 1500
    assert max(decoded_lengths) <= 6


class BackendOnly:
    """A fast tokenizer whose transformers-level decode must never run (it would re-decode with clean-up)."""

    def __init__(self, tokenizer) -> None:
        self.backend_tokenizer = tokenizer.backend_tokenizer

    def decode(self, *args, **kwargs) -> str:
        raise AssertionError("the transformers-level decode was called")


def test_fast_tokenizers_decode_through_the_backend(tokenizer, stream_kind):
    ids = encode(tokenizer, TEXTS[0] + TEXTS[3])
    pieces, _ = stream(BackendOnly(tokenizer), ids)
    assert "".join(pieces) == TEXTS[0] + TEXTS[3]


class SlowTokenizer:
    """A tokenizer without a backend (transformers' Python tokenizers): only ``decode``."""

    def __init__(self, tokenizer) -> None:
        self.inner = tokenizer

    def decode(self, ids, skip_special_tokens=False, **kwargs) -> str:
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens, **kwargs)


@pytest.mark.parametrize("text", TEXTS[:3])
def test_slow_tokenizers_decode_without_space_clean_up(tokenizer, text):
    pieces, _ = stream(SlowTokenizer(tokenizer), encode(tokenizer, text))
    assert "".join(pieces) == text
