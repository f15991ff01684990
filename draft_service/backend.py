"""The contract between the gateway and a draft: in process or over gRPC, the same calls.

``start`` builds the draft's own KV over the prompt from the target's EAGLE-3 features;
``propose`` expands a token tree rooted at the last emitted token under the session's policy;
``accept`` extends the draft KV with the features of the tokens the target committed;
``release`` frees the session's draft KV and arena slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from diffspec.tree import DraftTree


@dataclass(frozen=True)
class DraftOptions:
    policy: str = "full"  # chain, uniform<K>, full, online
    tree_config: str = "64:0.08:8"  # total_tokens:threshold:depth
    salience: bool = False  # attend to a selected working set instead of the whole context


@dataclass(frozen=True)
class DraftStats:
    """What the draft reports about a session at its end (hazard, working set)."""

    hazard: list[float] = field(default_factory=list)  # h(d) per depth, as last estimated
    working_set_tokens: int = 0  # tokens the draft attended to at the last step
    context_tokens: int = 0  # tokens in the draft's full context


class DraftBackend(Protocol):
    async def start(
        self,
        session_id: str,
        prompt_ids: list[int],
        features: torch.Tensor,  # [prompt_len, 3 * target_hidden]
        first_token: int,
        options: DraftOptions,
    ) -> None: ...

    async def propose(self, session_id: str) -> DraftTree: ...

    async def accept(
        self,
        session_id: str,
        emitted_tokens: list[int],  # accepted drafts then the bonus token
        features: torch.Tensor,  # [len(emitted_tokens), 3 * target_hidden]: root + accepted positions
    ) -> None: ...

    async def stats(self, session_id: str) -> DraftStats: ...

    async def release(self, session_id: str) -> None: ...
