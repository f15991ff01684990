"""What a client asks the gateway for, what it gets back, and the per-request statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from diffspec.feature_rows import Features
from diffspec.sampling_params import SamplingParams, TokenLogprobs
from draft_service.options import DraftOptions

if TYPE_CHECKING:
    from gateway.running_request import RunningRequest


@dataclass(eq=False)
class PromptShare:
    """The prompt work that the n samples of one request share (``gateway/samples.py``); the engine thread
    alone reads and writes it.

    The first sample to open computes the prompt (the source); the others wait unopened while it
    prefills. Once its prompt is done it records its target session and prompt features, and each
    other sample forks that session's prompt pages (copy-on-write) and starts its draft on the same
    features, so the prompt is computed once for all n."""

    source: RunningRequest | None = None  # the sample computing the prompt, once one has opened
    session_id: str = ""  # the target session holding the prompt's pages; "" until one is prefilled
    features: Features | None = None  # [prompt, 3 * hidden] its prompt's feature rows, when it drafts
    forks_left: int = 0  # samples that may still fork it; the features are dropped when none is left


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]  # target-vocab ids, <|bos|> included when the tokenizer adds it
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_sequences: tuple[str, ...] = ()
    draft: DraftOptions | None = None  # None = Auto (target-only decoding)
    n: int = 1  # independent samples of the prompt; the engine runs one request per sample (gateway/samples.py)
    client: str = ""  # who asked (gateway/quota.py): the quota key and the prefix-cache scope; "" = this process
    stop_token_ids: frozenset[int] = frozenset()  # a generated id among these ends the request, as EOS does
    prompt_share: PromptShare | None = None  # set on each sample of an n > 1 request


@dataclass
class GenerationStats:
    """Per-request numbers; tau counts accepted drafts + 1 bonus per verification step."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0  # target forwards after prefill (verify or decode)
    accepted_drafts: int = 0
    stop_depth_histogram: list[int] = field(default_factory=list)  # [depth] -> steps whose accepted path stopped there
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    decode_seconds: float = 0.0  # wall time from the first token to the last
    finish_reason: str = ""  # length, eos, stop, context
    fell_back_to_auto: bool = False  # the draft went away and the target finished alone
    hazard: list[float] = field(default_factory=list)
    working_set_tokens: int = 0
    working_set_updates: int = 0  # times the draft's working set changed: each costs an arena update

    @property
    def mean_accepted_length(self) -> float:
        return (self.accepted_drafts + self.steps) / self.steps if self.steps else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first (which prefill made) per decode second; 0 when none came after it."""
        return (self.new_tokens - 1) / self.decode_seconds if self.new_tokens > 1 and self.decode_seconds > 0 else 0.0

    def record_step(self, num_accepted: int) -> None:
        self.steps += 1
        self.accepted_drafts += num_accepted
        while len(self.stop_depth_histogram) <= num_accepted:
            self.stop_depth_histogram.append(0)
        self.stop_depth_histogram[num_accepted] += 1

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "steps": self.steps,
            "accepted_drafts": self.accepted_drafts,
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "stop_depth_histogram": self.stop_depth_histogram,
            "prefill_seconds": round(self.prefill_seconds, 6),
            "draft_seconds": round(self.draft_seconds, 6),
            "verify_seconds": round(self.verify_seconds, 6),
            "decode_seconds": round(self.decode_seconds, 6),
            "decode_tokens_per_second": round(self.decode_tokens_per_second, 3),
            "finish_reason": self.finish_reason,
            "fell_back_to_auto": self.fell_back_to_auto,
            "hazard": [round(h, 4) for h in self.hazard],
            "working_set_tokens": self.working_set_tokens,
            "working_set_updates": self.working_set_updates,
        }


@dataclass(frozen=True)
class GenerationChunk:
    token_ids: list[int]  # new generated ids in this chunk
    text: str  # the text they complete (may lag a token behind for split characters)
    stats: GenerationStats | None = None  # set on the last chunk only
    prefill_progress: tuple[int, int] | None = None  # (prompt tokens done, prompt tokens) while a prompt prefills
    logprobs: TokenLogprobs | None = None  # of token_ids, when the sampling asks for logprobs
    index: int = 0  # which of the request's n samples the chunk belongs to
