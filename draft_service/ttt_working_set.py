"""Training a head as it is served with salience: each position attends to a working set, not its whole past.

Why. A head trained on short windows with full causal attention meets, at 64K in serving, a working set of
sinks, recent chunks and best-scoring chunks scattered over the whole context, at relative distances it
never saw. Trained under the same rule over long windows, it learns to read what serving gives it.

Rule, per block of ``chunk_size`` query positions (the selection changes at each chunk boundary; serving
re-selects every few steps, a few tokens each). The block starting at position p has p / chunk_size full
chunks before it; its working set is chosen as serving chooses a prompt's (``draft_context``,
``working_set``): every chunk scored by Quest's bound against the step-0 query at p - 1 (the newest entry
when the set is chosen), ranked on the device, sinks and recent chunks forced, the best of the rest up to
the budget, and every chunk when they all fit. A query at t >= p attends to the keys of the chosen chunks,
to its own block's keys up to t (the tail), and in unrolled step k to its own keys of steps 1..k (a depth-k
node's ancestors), as ``ttt_unroll`` does without a working set. The selection reads detached keys: it is a
choice, not a function to differentiate. With ``compact_positions`` the chosen keys are re-roped to follow one
another up to the block, as serving's arena holds them (``chunk_arena``).

Cost. The chosen keys are gathered per block, once per window: [batch, blocks, budget] keys and values. Each
unrolled step keeps a [blocks, heads, chunk_size, budget] softmax for the backward pass. So memory grows as
length x budget, not length squared: a 64K window of bench-code's head under a 2,048-token budget (bf16) keeps
about 3 GB of keys and values and about 3 GB a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from diffspec_kernels.chunk_scoring_ref import chunk_scores_reference
from diffspec_kernels.draft_attention_ref import draft_attention_reference
from diffspec_kernels.layer_ops_ref import apply_rotary
from draft_service.chunk_arena import compacted_shifts
from draft_service.draft_context import Rope
from draft_service.working_set import (
    WorkingSetConfig,
    WorkingSetSelector,
    choose_candidates,
    forced_counts,
    select_working_sets,
)

# Blocks scored at a time: the scoring gathers every chunk's min and max keys per block, [blocks, chunks, kv_heads,
# hd] floats each (a 64K window of bench-code's 3 x 128 head: 1,024 x 1,024 x 384, 3.2 GB for both at once).
SCORED_ROWS = 256


@dataclass(frozen=True)
class BlockWorkingSets:
    """Per block of ``chunk_size`` query positions, the context positions its queries attend to besides their
    own block's."""

    chunk_size: int
    chunks: list[list[list[int]]]  # [batch][block] chosen chunk ids, ascending (block 0 has none)
    positions: torch.Tensor  # [batch, blocks, width] int64 positions of the chosen chunks' keys, 0 past lengths
    lengths: torch.Tensor  # [batch, blocks] int64 valid entries of each row of ``positions``
    # [batch, blocks, width] int64 how far each key's position moves with compacted positions (``chunk_arena``'s
    # ``compacted_shifts``); None: the keys keep their own
    shifts: torch.Tensor | None = None

    @property
    def num_blocks(self) -> int:
        return self.positions.shape[1]


@torch.no_grad()
def choose_block_working_sets(
    q0: torch.Tensor,  # [B, L, heads, hd] step-0 queries (roped)
    k0: torch.Tensor,  # [B, L, kv_heads, hd] step-0 keys (roped)
    config: WorkingSetConfig,
) -> BlockWorkingSets:
    """Each block's working set, chosen by serving's rule (see the module): the blocks scored ``SCORED_ROWS`` at a
    time, ranked in one launch, then the host's selection on a few dozen ids a block."""
    batch, length = k0.shape[:2]
    size = config.chunk_size
    blocks, full = -(-length // size), length // size
    rows = [(b, block) for b in range(batch) for block in range(1, blocks)]  # blocks with chunks before them
    chunks: list[list[list[int]]] = [[[] for _ in range(blocks)] for _ in range(batch)]
    if rows:
        keys = k0[:, : full * size].unflatten(1, (full, size))  # [B, chunks, size, kv_heads, hd]
        key_min, key_max = keys.amin(2), keys.amax(2)  # each sequence's chunks are one page
        owner = torch.tensor([b for b, _ in rows], device=k0.device)
        num_chunks = torch.tensor([block for _, block in rows], device=k0.device)
        queries = q0[owner, num_chunks * size - 1]  # [rows, heads, hd] the newest entry at each choice
        scores = torch.cat([
            chunk_scores_reference(queries[i : i + SCORED_ROWS], key_min, key_max, owner[i : i + SCORED_ROWS, None],
                                   num_chunks[i : i + SCORED_ROWS])
            for i in range(0, len(rows), SCORED_ROWS)
        ])  # fmt: skip
        forced = torch.tensor(forced_counts([config] * len(rows)), device=k0.device)
        ranked = choose_candidates(scores, num_chunks, forced, config.max_chunks)
        selectors = [WorkingSetSelector(config) for _ in rows]  # fresh: each block chooses anew
        selected = select_working_sets(selectors, ranked.cpu().numpy(), num_chunks.cpu().numpy())
        for (b, block), ids in zip(rows, selected):
            chunks[b][block] = ids
    width = max((len(ids) for per_block in chunks for ids in per_block), default=0) * size
    positions = np.zeros((batch, blocks, width), dtype=np.int64)
    shifts = np.zeros((batch, blocks, width), dtype=np.int64) if config.compact_positions else None
    lengths = np.zeros((batch, blocks), dtype=np.int64)
    offsets = np.arange(size)
    for b, per_block in enumerate(chunks):
        for block, ids in enumerate(per_block):
            if ids:
                flat = (np.asarray(ids)[:, None] * size + offsets).ravel()
                positions[b, block, : flat.size], lengths[b, block] = flat, flat.size
                if shifts is not None:
                    shifts[b, block, : flat.size] = np.repeat(compacted_shifts(ids, size), size)
    device = k0.device
    return BlockWorkingSets(size, chunks, torch.from_numpy(positions).to(device), torch.from_numpy(lengths).to(device),
                            None if shifts is None else torch.from_numpy(shifts).to(device))  # fmt: skip


@dataclass(frozen=True)
class BlockContext:
    """The step-0 keys each block of queries sees: its chosen chunks' (gathered once, read by every unrolled
    step) and its own block's (causal within it)."""

    chunk_size: int
    chosen_k: torch.Tensor  # [B, blocks, width, kv_heads, hd] keys of the block's chosen chunks, padded
    chosen_v: torch.Tensor  # [B, blocks, width, kv_heads, hd]
    chosen_lengths: torch.Tensor  # [B, blocks] int64 valid rows of chosen_k
    block_k: torch.Tensor  # [B, blocks, chunk_size, kv_heads, hd] the block's own keys, zeros past the window
    block_v: torch.Tensor  # [B, blocks, chunk_size, kv_heads, hd]

    def by_block(self, x: torch.Tensor) -> torch.Tensor:
        """[B, <= blocks * chunk_size, ...] rows by position -> [B, blocks, chunk_size, ...]."""
        return _by_block(x, self.block_k.shape[1], self.chunk_size)


def gather_block_context(
    k0: torch.Tensor,  # [B, L, kv_heads, hd] step-0 keys
    v0: torch.Tensor,  # [B, L, kv_heads, hd]
    sets: BlockWorkingSets,
    rope: Rope | None = None,  # the head's cos/sin of positions: with compacted sets, the chosen keys move by them
) -> BlockContext:
    owner = torch.arange(k0.shape[0], device=k0.device)[:, None, None]
    blocks, size = sets.num_blocks, sets.chunk_size
    chosen_k = k0[owner, sets.positions]
    if sets.shifts is not None:
        if rope is None:
            raise ValueError("compacted working sets need the head's rope")
        chosen_k = apply_rotary(chosen_k, *rope(sets.shifts))  # as serving restages its arena
    return BlockContext(
        size, chosen_k, v0[owner, sets.positions], sets.lengths, _by_block(k0, blocks, size), _by_block(v0, blocks, size),
    )  # fmt: skip


def working_set_attention(
    q: torch.Tensor,  # [B, L', heads, hd] one unrolled step's queries of positions 0..L'-1
    context: BlockContext,  # the step-0 keys each block sees (L' <= the window's positions)
    diag_k: torch.Tensor,  # [B, L', n, kv_heads, hd] each position's own keys of steps 1..n (n may be 0)
    diag_v: torch.Tensor,  # [B, L', n, kv_heads, hd]
    scale: float,
) -> torch.Tensor:  # [B, L', heads, hd]
    """``ttt_unroll.ttt_attention`` under the working set: per block, the chosen chunks' keys are the context
    and the block's own keys (causal) and each query's own unrolled keys are the new entries, one float32
    softmax over both (the serving attention's reference, ``draft_attention_reference``)."""
    batch, length = q.shape[:2]
    blocks, size, n = *context.block_k.shape[1:3], diag_k.shape[2]
    new_k = torch.cat([context.block_k, context.by_block(diag_k).flatten(2, 3)], dim=2)  # own steps: (position, step)
    new_v = torch.cat([context.block_v, context.by_block(diag_v).flatten(2, 3)], dim=2)
    rows = torch.arange(size, device=q.device)
    causal = rows[None, :] <= rows[:, None]  # [size, size] within the block
    own = (rows[None, :] == rows[:, None]).repeat_interleave(n, dim=1)  # [size, size * n] a query's own steps
    mask = torch.cat([causal, own], dim=1).expand(batch, blocks, size, size * (1 + n))
    out = draft_attention_reference(
        context.by_block(q), context.chosen_k, context.chosen_v, new_k, new_v, mask, scale, context.chosen_lengths
    )  # fmt: skip
    return out.flatten(1, 2)[:, :length]


def _by_block(x: torch.Tensor, blocks: int, size: int) -> torch.Tensor:
    """[B, <= blocks * size, ...] rows by position -> [B, blocks, size, ...], zeros appended."""
    missing = blocks * size - x.shape[1]
    if missing:
        x = torch.cat([x, x.new_zeros(x.shape[0], missing, *x.shape[2:])], dim=1)
    return x.unflatten(1, (blocks, size))
