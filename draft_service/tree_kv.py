"""One growing draft tree's own entries on the device: keys, values and who sees whom.

Entries arrive a depth at a time and each sees its ancestors' entries and itself. Buffers are
preallocated for the tree's plan, so a depth writes its rows in place (no per-depth concat of
the tree so far), and each entry's path (its ancestors' entries then its own) is kept on the
device, so a depth's mask rows come from its parents' paths by one gather and one scatter
instead of a host loop per node.
"""

from __future__ import annotations

import torch


class TreeKV:
    def __init__(
        self, capacity: int, max_depth: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.keys = torch.empty(capacity, num_kv_heads, head_dim, dtype=dtype, device=device)  # [capacity, kv_heads, hd]
        self.values = torch.empty_like(self.keys)
        # [capacity + 1, max_depth]: paths[e, i] = entry of e's depth-(i + 1) ancestor (e itself at its own depth);
        # max_depth bounds the entries' depths; the extra last row stands for the root, which has no entry.
        self.paths = torch.zeros(capacity + 1, max_depth, dtype=torch.int64, device=device)
        self.length = 0  # entries written

    @property
    def root(self) -> int:
        """The path row to name as the parent of depth-1 entries."""
        return self.paths.shape[0] - 1

    def append(self, k: torch.Tensor, v: torch.Tensor, parents: torch.Tensor, depth: int) -> torch.Tensor:
        """Add depth-``depth`` entries k, v [n, kv_heads, hd] whose parents' entries are ``parents`` [n]
        (``root`` for depth 1) -> mask [n, length] bool: the entries each new one sees."""
        start, stop = self.length, self.length + k.shape[0]
        self.keys[start:stop] = k
        self.values[start:stop] = v
        self.paths[start:stop] = self.paths[parents]
        self.paths[start:stop, depth - 1] = torch.arange(start, stop, device=self.paths.device)
        self.length = stop
        mask = torch.zeros(stop - start, stop, dtype=torch.bool, device=self.keys.device)
        return mask.scatter_(1, self.paths[start:stop, :depth], True)

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[length, kv_heads, hd] keys and values of every entry so far."""
        return self.keys[: self.length], self.values[: self.length]
