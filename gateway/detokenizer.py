"""Incremental detokenization with stop sequences, one token at a time, in O(1) per token.

Each token's text comes from a decode stream over a window of the last few tokens: tokenizers'
``DecodeStream`` (tokenizers >= 0.21), or ``OffsetDecodeStream``, the same prefix/read-offset
algorithm in Python, before that. A stream releases nothing while the window ends inside a UTF-8
character, so a character split over tokens is never cut. Decoding goes through the fast
tokenizer's backend, never ``PreTrainedTokenizer.decode``: transformers 4.x applies
``clean_up_tokenization_spaces`` there (Llama-3.1's tokenizer config turns it on), which streams
``x != y`` as ``x!= y``, and re-decoding the whole output at every token costs O(n^2).

Stop sequences: text is released only when it is final, so a tail that could still grow into a
stop sequence is held back (at most the longest stop sequence's length); when a stop sequence
appears, the text before it is the last text released.
"""

from __future__ import annotations

from typing import Callable, Protocol

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21 (transformers 4.45-4.46 pin it)
    DecodeStream = None


class Tokenizer(Protocol):
    """A Hugging Face tokenizer: fast ones carry ``backend_tokenizer``, slow ones only ``decode``."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ..., **kwargs: bool) -> str: ...


DecodeFn = Callable[[list[int]], str]


def window_decoder(tokenizer: Tokenizer) -> DecodeFn:
    """ids -> text with special tokens skipped and no space clean-up, on transformers 4.x and 5.x."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


class OffsetDecodeStream:
    """``DecodeStream``'s algorithm: the window holds the last released token(s) and the pending
    ones; a step releases what the window's text adds to its prefix's text, unless it ends in half
    a character. The window then restarts at the tokens just released."""

    def __init__(self, decode: DecodeFn) -> None:
        self.decode = decode
        self.ids: list[int] = []  # the window: the last released token(s), then the pending ones
        self.prefix = ""  # decode(ids[:prefix_index])
        self.prefix_index = 0

    def step(self, token_id: int) -> str | None:
        self.ids.append(token_id)
        text = self.decode(self.ids)
        if len(text) <= len(self.prefix) or text.endswith("\ufffd"):
            return None
        if not text.startswith(self.prefix):
            raise ValueError(f"decoding one more token changed the text before it: {self.prefix!r} -> {text!r}")
        piece = text[len(self.prefix) :]
        self.ids = self.ids[self.prefix_index :]
        self.prefix = self.decode(self.ids)
        self.prefix_index = len(self.ids)
        return piece


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop_sequences: tuple[str, ...] = ()) -> None:
        self.decode = window_decoder(tokenizer)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if DecodeStream is not None and backend is not None:
            stream = DecodeStream(skip_special_tokens=True)
            self.next_piece: Callable[[int], str | None] = lambda token_id: stream.step(backend, token_id)
        else:
            self.next_piece = OffsetDecodeStream(self.decode).step
        self.stop_sequences = tuple(s for s in stop_sequences if s)
        self.undecoded: list[int] = []  # tokens the stream holds (inside a character or special)
        self.pending = ""  # decoded, not yet released: a tail that may begin a stop sequence
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one generated token; return the newly final text (may be empty)."""
        if self.stopped:
            return ""
        piece = self.next_piece(token_id)
        if piece is None:
            self.undecoded.append(token_id)
            return ""
        self.undecoded.clear()
        return self._release(self.pending + piece)

    def flush(self) -> str:
        """Everything still held back, at the end of a generation that did not stop on a sequence:
        a character cut off by the length limit comes out as U+FFFD, as a full decode gives it."""
        if self.stopped:
            return ""
        text = self.pending + (self.decode(self.undecoded) if self.undecoded else "")
        self.pending, self.undecoded = "", []
        return text

    def _release(self, text: str) -> str:
        hits = [h for h in (text.find(s) for s in self.stop_sequences) if h >= 0]
        if hits:
            self.stopped, self.pending = True, ""
            return text[: min(hits)]
        held = self._stop_prefix_length(text)
        self.pending = text[len(text) - held :]
        return text[: len(text) - held]

    def _stop_prefix_length(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop sequence."""
        best = 0
        for stop in self.stop_sequences:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
