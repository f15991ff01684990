"""The draft's prefix cache: its KV of a prompt's leading positions, kept by token chain after the session ends.

A later prompt that starts the same way (a shared system prompt or document, the next turn of a conversation,
the next arm of a benchmark over the same prompt) then needs neither the target's features for those positions
nor the head's pass over them, and the target, whose own prefix cache holds their KV, skips their forward too:
the target computes features only from where the draft's cached chain ends (``SessionOpen.features_from``).

Keys. Entry t pairs the target's feature at position t with token t + 1 (``Drafter.start``), so the entries of
block j, positions [jB, (j+1)B), are a function of tokens [0, (j+1)B]: block j's key is (the previous block's
chain hash, tokens jB + 1 .. (j+1)B), and the chain starts from the cache scope (the tenant) and token 0. A
prompt of n tokens can use blocks up to position n - 1: the entry at n - 1 pairs with the first generated token.
Keys hold whole token tuples, so a hit is exact; string hashes are salted per process, so no client can build
a chain that lands in another scope.

Lifecycle. ``lookup`` pins the longest cached chain of a prompt for a session before the target opens it;
``load`` copies the pinned blocks into the session's context at its start and unpins them; ``unpin`` frees a
pin its session never took (a request that ended or failed first). ``store`` keeps the full blocks of a
session's committed entries, at its start and at its end. Blocks no pin holds are evicted least recently used
first, a chain's tail before its head; a block whose parent was evicted stays keyed by content and is found
again once the parent is stored again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

import torch

from diffspec.devices import upload
from draft_service.draft_context import DraftContext

PREFIX_BLOCK_TOKENS = 64  # entries a cache block holds: the granularity of a hit

PrefixKey = tuple[int, tuple[int, ...]]  # (chain hash of the previous block, the tokens this block's entries pair with)


class DraftPrefixCache:
    """Fixed-size block storage on the head's device, for every decoder layer of the head."""

    def __init__(
        self,
        capacity_tokens: int,
        block_tokens: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if block_tokens < 1 or capacity_tokens < block_tokens:
            raise ValueError(f"a cache of {capacity_tokens} tokens cannot hold a block of {block_tokens}")
        self.block_tokens = block_tokens
        self.num_blocks = capacity_tokens // block_tokens
        shape = (num_layers, self.num_blocks, block_tokens, num_kv_heads, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)  # [layers, blocks, block_tokens, kv_heads, hd]
        self.values = torch.empty_like(self.keys)
        self._block_of: dict[PrefixKey, int] = {}
        self._key_of: dict[int, PrefixKey] = {}  # inverse of _block_of
        self._pins = [0] * self.num_blocks  # [blocks] sessions holding each block
        self._free = list(range(self.num_blocks - 1, -1, -1))  # never used: popped from the end, block 0 first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unpinned: least recently used first
        # session -> the cache block of each leading block of entries its lookup pinned, in position order
        self._pinned: dict[str, tuple[int, ...]] = {}
        self.looked_up_entries = 0  # prompt entries lookups could have found (their usable blocks), for the hit rate
        self.hit_entries = 0  # of them, found

    @property
    def cached_blocks(self) -> int:
        return len(self._block_of)

    @property
    def pinned_sessions(self) -> int:
        return len(self._pinned)

    def lookup(self, session_id: str, scope: str, prompt_ids: Sequence[int]) -> int:
        """Pin the longest cached chain ``prompt_ids`` starts with for ``session_id``; the entries it holds."""
        if session_id in self._pinned:
            raise ValueError(f"session {session_id!r} already holds a cached prefix")
        usable = (len(prompt_ids) - 1) // self.block_tokens  # blocks that end before the prompt's last position
        blocks = []
        for key in self._chain(scope, prompt_ids, usable):
            block = self._block_of.get(key)
            if block is None:
                break
            blocks.append(block)
        for block in blocks:
            self._pins[block] += 1
            self._evictable.pop(block, None)
        self._pinned[session_id] = tuple(blocks)
        self.looked_up_entries += usable * self.block_tokens
        self.hit_entries += len(blocks) * self.block_tokens
        return len(blocks) * self.block_tokens

    def pinned(self, session_id: str) -> int:
        """Entries the session's pin holds (0 when it has none)."""
        return len(self._pinned.get(session_id, ())) * self.block_tokens

    def load(self, session_id: str, context: DraftContext, positions: int) -> int:
        """Copy the first ``positions`` entries of the session's pin into the empty ``context`` and unpin it;
        returns ``positions``."""
        held = self.pinned(session_id)
        if not 0 <= positions <= held or positions % self.block_tokens or context.length:
            raise ValueError(f"cannot load {positions} cached entries: {held} pinned, {context.length} in the context")
        if positions:
            blocks = self._on_device(self._pinned[session_id][: positions // self.block_tokens])
            for layer, (keys, values) in enumerate(context.claim(positions)):
                keys.view(-1, *self.keys.shape[2:]).copy_(self.keys[layer].index_select(0, blocks))
                values.view(-1, *self.values.shape[2:]).copy_(self.values[layer].index_select(0, blocks))
        self.unpin(session_id)
        return positions

    def unpin(self, session_id: str) -> None:
        """Let the session's chain go (no-op without one): its blocks become evictable, its tail first."""
        for block in reversed(self._pinned.pop(session_id, ())):
            self._pins[block] -= 1
            if self._pins[block] == 0:
                self._evictable[block] = None

    def store(self, scope: str, token_ids: Sequence[int], context: DraftContext) -> int:
        """Keep every full block of ``context``'s committed entries, whose tokens are ``token_ids`` [entries + 1]
        (token 0, then each entry's next token); blocks already cached are only refreshed. Returns the blocks
        added (fewer when every block is pinned)."""
        if len(token_ids) != context.length + 1:
            raise ValueError(f"{len(token_ids)} tokens for {context.length} entries; expected one more")
        chain = list(enumerate(self._chain(scope, token_ids, context.length // self.block_tokens)))
        held = [block for _, key in chain if (block := self._block_of.get(key)) is not None]
        for block in reversed(held):  # refreshed, the head most recent, so the tail goes first
            if block in self._evictable:
                self._evictable.move_to_end(block)
        added: list[tuple[int, int]] = []  # (chain index, block)
        keep = set(held)  # this chain's blocks: never evicted to store the rest of it
        for index, key in chain:
            if key in self._block_of:
                continue
            block = self._take_block(keep)
            if block is None:
                break
            self._block_of[key], self._key_of[block] = block, key
            added.append((index, block))
            keep.add(block)
        if added:
            self._copy_in(context, added)
        for _, block in reversed(added):
            self._evictable[block] = None
        return len(added)

    def _copy_in(self, context: DraftContext, added: list[tuple[int, int]]) -> None:
        size = self.block_tokens
        indexes, blocks = self._on_device([index for index, _ in added] + [block for _, block in added]).split(len(added))
        for layer in range(self.keys.shape[0]):
            for cache, committed in zip((self.keys, self.values), context.committed(layer)):
                whole = committed[: len(committed) // size * size].view(-1, size, *committed.shape[1:])  # [blocks, ...]
                cache[layer].index_copy_(0, blocks, whole.index_select(0, indexes))

    def _on_device(self, values: Sequence[int]) -> torch.Tensor:
        """Block indices on the cache's device without a stream sync: a start or a release runs inside a draft
        step, with the device's queue still busy."""
        return upload(torch.tensor(values, dtype=torch.int64), self.keys.device)

    def _take_block(self, keep: set[int]) -> int | None:
        """A never-used block, else the least recently used unpinned one (out of the cache), or None. ``keep``:
        blocks of the chain being stored, never evicted for it."""
        if self._free:
            return self._free.pop()
        for block in self._evictable:
            if block not in keep:
                del self._evictable[block]
                del self._block_of[self._key_of.pop(block)]
                return block
        return None

    def _chain(self, scope: str, token_ids: Sequence[int], num_blocks: int) -> Iterator[PrefixKey]:
        """The keys of the first ``num_blocks`` blocks of entries over ``token_ids`` (at least num_blocks * B + 1),
        each hashed only when asked for: a lookup that misses early hashes no more of a long prompt."""
        if num_blocks <= 0:
            return
        size, previous = self.block_tokens, hash(("draft_prefix", scope, token_ids[0]))
        for j in range(num_blocks):
            key = (previous, tuple(token_ids[j * size + 1 : (j + 1) * size + 1]))
            yield key
            previous = hash(key)
