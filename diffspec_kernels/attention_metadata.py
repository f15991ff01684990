"""What every tree-attention implementation needs to know about a batch, built once per forward.

A batch is a list of sequences, each with ``q_len`` new tokens (a prefill chunk, a draft tree,
or one decode token) appended after ``context_len`` committed tokens held in KV pages. The new
tokens see every committed token, and each other as the per-sequence ``new_token_mask`` says
(causal for a prefill chunk, ancestors for a tree).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffspec.devices import upload


@dataclass(frozen=True)
class AttentionMetadata:
    q_lens: list[int]  # [batch] new tokens per sequence (host copy, for loops and shapes)
    cu_q_lens: torch.Tensor  # [batch + 1] int32, prefix sums of q_lens (device)
    context_lens_t: torch.Tensor  # [batch] int32 committed tokens per sequence (device only: a graph refills it)
    block_tables: torch.Tensor  # [batch, max_pages_per_seq] int32, padded with 0 (device)
    new_token_mask: torch.Tensor  # [total_q, max_q_len] bool: row i (a new token) sees new token j of its own sequence
    page_size: int

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)

    @property
    def max_q_len(self) -> int:
        return max(self.q_lens)

    @staticmethod
    def build(
        q_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        masks: list[torch.Tensor],
        page_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        """Pack per-sequence facts; ``masks[b]`` is [q_lens[b], q_lens[b]] bool."""
        max_q = max(q_lens)
        packed = torch.zeros(sum(q_lens), max_q, dtype=torch.bool)
        row = 0
        for q_len, mask in zip(q_lens, masks):
            packed[row : row + q_len, :q_len] = mask
            row += q_len
        max_pages = max(1, max(len(t) for t in block_tables))
        tables = torch.zeros(len(block_tables), max_pages, dtype=torch.int32)
        for b, table in enumerate(block_tables):
            tables[b, : len(table)] = torch.tensor(table, dtype=torch.int32)
        cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
        return AttentionMetadata(
            q_lens=list(q_lens),
            cu_q_lens=upload(cu, device),
            context_lens_t=upload(torch.tensor(context_lens, dtype=torch.int32), device),
            block_tables=upload(tables, device),
            new_token_mask=upload(packed, device),
            page_size=page_size,
        )


def causal_mask(num_tokens: int) -> torch.Tensor:
    """[num_tokens, num_tokens] bool lower-triangular mask for a prefill chunk."""
    return torch.ones(num_tokens, num_tokens, dtype=torch.bool).tril()
