"""A batch of growing draft trees' own entries on the device: keys, values and who sees whom.

Depth d >= 1 of a proposal runs the head once on a fixed number of frontier rows per session
(``depth_rows[d - 1]``); each row's entry goes to a fixed place, depth after depth, so the
buffers are sized once per proposal shape and a depth writes its rows in place (``entries``): no
concat, no host loop, the same addresses on every replay of a CUDA graph. Each decoder layer of
the head has its own keys and values at those places; who sees whom is the same for every layer.
An entry sees its ancestors' entries and itself; its row of ``sees`` is its parent's row plus
itself (the root has no entry, so depth-1 rows see only themselves). Entries of depths not
written yet hold stale values that no row sees.
"""

from __future__ import annotations

import itertools

import torch


class TreeKV:
    def __init__(
        self,
        batch: int,
        depth_rows: list[int],
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        num_layers: int = 1,
    ) -> None:
        self.starts = [0, *itertools.accumulate(depth_rows)]  # depth d's entries: starts[d - 1]:starts[d]
        entries = self.starts[-1]
        shape = (num_layers, batch, entries, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [layers, B, E, kv, hd]
        self.values = torch.zeros_like(self.keys)  # [layers, B, E, kv, hd]
        self.sees = torch.zeros(batch, entries, entries, dtype=torch.bool, device=device)  # [B, E, E]
        self._own = torch.eye(entries, dtype=torch.bool, device=device)  # [E, E]: each entry sees itself

    @property
    def num_entries(self) -> int:
        return self.keys.shape[2]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder layer ``layer``'s keys and values of every entry [B, E, kv_heads, hd]."""
        return self.keys[layer], self.values[layer]

    def entries(self, depth: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Depth ``depth``'s entry slots of decoder layer ``layer``: keys, values [B, rows, kv_heads, hd], views to
        write in place."""
        start, stop = self.starts[depth - 1], self.starts[depth]
        return self.keys[layer, :, start:stop], self.values[layer, :, start:stop]

    def link(self, depth: int, parent_rows: torch.Tensor) -> torch.Tensor:
        """Record who depth ``depth``'s entries see; ``parent_rows`` [B, rows] int64 are their parents' rows at
        the previous depth (ignored at depth 1: the root has no entry) -> [B, rows, E] bool, a view."""
        start, stop = self.starts[depth - 1], self.starts[depth]
        sees = self.sees[:, start:stop]
        own = self._own[start:stop]  # [rows, E]
        if depth == 1:
            sees.copy_(own.expand_as(sees))
        else:
            previous = self.sees[:, self.starts[depth - 2] : start]  # [B, parent rows, E]
            ancestors = previous.gather(1, parent_rows[..., None].expand(-1, -1, self.num_entries))
            torch.bitwise_or(ancestors, own, out=sees)
        return sees
