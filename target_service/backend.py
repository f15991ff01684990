"""The contract between the gateway and a target: in process or over gRPC, the same calls.

A session is one generation. ``prefill`` opens it and returns the first token; each ``verify``
checks a draft tree rooted at the last emitted token and commits the accepted path's KV;
``decode`` is Auto's single-token step; ``release`` frees every page the session holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from diffspec.sampling import SamplingParams
from diffspec.tree import DraftTree

# progress(done_tokens, total_tokens) during a long prefill
PrefillProgress = Callable[[int, int], None]


@dataclass(frozen=True)
class PrefillResult:
    first_token: int  # sampled from the last prompt position
    features: torch.Tensor | None  # [prompt_len, 3 * hidden] EAGLE-3 features (None unless asked for)
    num_cached_tokens: int  # prompt tokens whose KV came from shared prefix pages


@dataclass(frozen=True)
class VerifyResult:
    accepted_tokens: list[int]  # draft tokens accepted, in order (root and bonus excluded)
    accepted_nodes: list[int]  # their tree node indices
    bonus_token: int  # the target's token after the accepted path; the next tree's root
    features: torch.Tensor | None  # [1 + len(accepted), 3 * hidden] at the root and accepted positions

    @property
    def emitted_tokens(self) -> list[int]:
        """What the client receives from this step: accepted drafts, then the bonus."""
        return [*self.accepted_tokens, self.bonus_token]


@dataclass(frozen=True)
class TargetInfo:
    model: str  # checkpoint path or name
    vocab_size: int
    hidden_size: int
    num_layers: int
    feature_layers: tuple[int, ...]
    eos_token_ids: tuple[int, ...]
    max_context: int  # tokens (prompt + generated)
    page_size: int
    num_pages: int
    num_free_pages: int
    active_sessions: int
    device: str
    dtype: str
    extra: dict[str, float] = field(default_factory=dict)


class TargetBackend(Protocol):
    async def prefill(
        self,
        session_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        want_features: bool,
        progress: PrefillProgress | None = None,
    ) -> PrefillResult: ...

    async def verify(self, session_id: str, tree: DraftTree) -> VerifyResult: ...

    async def decode(self, session_id: str) -> VerifyResult: ...

    async def release(self, session_id: str) -> None: ...

    async def info(self) -> TargetInfo: ...
