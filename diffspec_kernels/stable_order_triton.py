"""The order both tree-ranking kernels share: stable descending order of float keys.

A slot's rank is how many slots come before it: those with a larger key, and those with an equal key at a
smaller slot index. That is the order ``torch.sort(..., descending=True, stable=True)`` gives, so the
kernels' trees equal their references' node for node, ties included.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def ahead_of(key, slots, other_key, others):
    """[BLOCK, OTHERS] int32: 1 where slot ``others[j]`` (key ``other_key[j]``) comes before slot ``slots[i]``
    (key ``key[i]``). A slot past the last one should carry key -inf and its own larger index: never ahead."""
    larger = other_key[None, :] > key[:, None]
    tied_earlier = (other_key[None, :] == key[:, None]) & (others[None, :] < slots[:, None])
    return (larger | tied_earlier).to(tl.int32)
