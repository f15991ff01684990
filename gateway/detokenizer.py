"""Incremental detokenization with stop sequences, one token at a time.

Text is released only when it is final: a trailing replacement character (half of a UTF-8
character split over tokens) and any tail that could still grow into a stop sequence are
held back. When a stop sequence appears, the text before it is the last text released.
"""

from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop_sequences: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop_sequences = tuple(s for s in stop_sequences if s)
        self.ids: list[int] = []
        self.released = 0  # characters of the decoded text already returned
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one generated token; return the newly final text (may be empty)."""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        hits = [text.find(s, max(0, self.released - len(s))) for s in self.stop_sequences]
        hits = [h for h in hits if h >= 0]
        if hits:
            self.stopped = True
            return self._release(text, min(hits))
        final = len(text.rstrip("\ufffd"))
        return self._release(text, final - self._stop_prefix_length(text[:final]))

    def flush(self) -> str:
        """Everything still held back, at the end of a generation that did not stop on a sequence."""
        if self.stopped:
            return ""
        return self._release(self.tokenizer.decode(self.ids, skip_special_tokens=True), None)

    def _release(self, text: str, end: int | None) -> str:
        end = len(text) if end is None else end
        delta = text[self.released : end] if end > self.released else ""
        self.released = max(self.released, end)
        return delta

    def _stop_prefix_length(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop sequence."""
        best = 0
        for stop in self.stop_sequences:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
