"""Block manager of the target's paged KV pool: block tables, refcounts, prefix cache, copy-on-write.

Logic only, no tensors: the pool hands out page ids and slots (slot = page * page_size + offset) and
emits PageCopy instructions; the tensor storage applies the copies, then writes KV into the slots.

Pages are shared (refcount > 1) in two ways:
- prefix cache: when a page's last token is committed, the page is registered under its chain key
  (previous page's chain hash, this page's token ids); a later prompt that starts with the same pages
  maps them instead of recomputing. A freed full page keeps its entry until it is handed out again.
  Chains start from the sequence's cache scope (the tenant), so a prompt only ever hits pages that
  its own scope committed: no page sharing, and so no timing, can tell one tenant another's prompt.
- fork: a child shares its parent's committed pages (or those of a prefix of its committed tokens, as
  the n samples of one prompt share the prompt's), a partial last page included.
Only positions >= num_committed are ever written, so full pages never change; a shared partial page is
copied before its next write (reserve), and commit refuses to write into a page that is still shared. A
child forked mid-page holds a full cached page as its partial last one: when it alone is left to write
into it, the page leaves the prefix cache first, so no later prompt maps the overwritten KV.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from diffspec.errors import InvalidRequest, KVPoolExhausted

PrefixKey = tuple[int, tuple[int, ...]]  # (chain hash of the previous page, this page's token ids)
# CPython's hash() never returns -1, so no real chain hash can collide with the first page's "previous"
# in the default scope.
_NO_PREVIOUS_PAGE = -1
DEFAULT_SCOPE = ""


def scope_root(cache_scope: str) -> int:
    """The "previous page" hash a scope's chains start from: str hashes are salted per process, so a
    client cannot build a chain that lands in another scope."""
    return _NO_PREVIOUS_PAGE if cache_scope == DEFAULT_SCOPE else hash(("cache_scope", cache_scope))


@dataclass(frozen=True)
class PageCopy:
    """Copy-on-write instruction: copy every slot of src_page into dst_page before writing dst_page."""

    src_page: int
    dst_page: int


class PagedKVPool:
    """Hands out KV pages to sequences and shares them by prefix and by fork; every failed call changes nothing."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages} and {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._refcounts = [0] * num_pages  # [num_pages]
        # Free pages, oldest-freed first. Pages still in the prefix cache wait apart and are handed out
        # only when no other page is free, so a revivable prefix survives as long as possible.
        self._free_pages: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))
        self._free_cached_pages: OrderedDict[int, None] = OrderedDict()
        self._prefix_cache: dict[PrefixKey, int] = {}  # chain key of a full page -> page holding its KV
        self._page_keys: dict[int, PrefixKey] = {}  # inverse of _prefix_cache
        self._block_tables: dict[str, list[int]] = {}  # seq_id -> [num_pages_of_seq]
        self._token_ids: dict[str, list[int]] = {}  # seq_id -> committed token ids, [num_committed]
        self._chain_hashes: dict[str, list[int]] = {}  # seq_id -> [scope root, chain hash of each full page]

    @property
    def num_free_pages(self) -> int:
        """Pages with refcount 0, including freed pages that still hold a revivable prefix."""
        return len(self._free_pages) + len(self._free_cached_pages)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    def refcount(self, page: int) -> int:
        return self._refcounts[page]

    def has_sequence(self, seq_id: str) -> bool:
        return seq_id in self._block_tables

    def sequences(self) -> list[str]:
        return list(self._block_tables)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new sequence of num_tokens fits now, counting no prefix hits (conservative)."""
        return self.pages_needed(num_tokens) <= self.num_free_pages

    def allocate(self, seq_id: str, prompt_ids: Sequence[int], cache_scope: str = DEFAULT_SCOPE) -> int:
        """Registers a sequence and holds pages for its whole prompt, so an admitted prompt never runs out
        of pages later. Leading full pages found in the prefix cache of ``cache_scope`` are shared, never
        the page holding the last prompt token: its forward pass yields the first output token. Returns
        num_cached_tokens, the sequence's initial committed length."""
        if seq_id in self._block_tables:
            raise InvalidRequest(f"sequence {seq_id!r} already exists")
        if not prompt_ids:
            raise InvalidRequest("a prompt needs at least one token")
        ps = self.page_size
        cached_pages: list[int] = []
        chain = [scope_root(cache_scope)]
        for i in range((len(prompt_ids) - 1) // ps):
            key = (chain[-1], tuple(prompt_ids[i * ps : (i + 1) * ps]))
            page = self._prefix_cache.get(key)
            if page is None:
                break
            cached_pages.append(page)
            chain.append(hash(key))
        num_revived = sum(1 for page in cached_pages if self._refcounts[page] == 0)
        num_new_pages = self.pages_needed(len(prompt_ids)) - len(cached_pages)
        if num_revived + num_new_pages > self.num_free_pages:
            raise KVPoolExhausted(
                f"prompt of {len(prompt_ids)} tokens needs {num_revived + num_new_pages} free pages, "
                f"{self.num_free_pages} left"
            )
        for page in cached_pages:
            if self._refcounts[page] == 0:
                del self._free_cached_pages[page]
            self._refcounts[page] += 1
        num_cached_tokens = len(cached_pages) * ps
        self._block_tables[seq_id] = cached_pages + [self._take_free_page() for _ in range(num_new_pages)]
        self._token_ids[seq_id] = list(prompt_ids[:num_cached_tokens])
        self._chain_hashes[seq_id] = chain
        return num_cached_tokens

    def num_committed(self, seq_id: str) -> int:
        """Tokens whose KV is written."""
        self._table(seq_id)
        return len(self._token_ids[seq_id])

    def committed_token_ids(self, seq_id: str) -> list[int]:
        self._table(seq_id)
        return list(self._token_ids[seq_id])

    def block_table(self, seq_id: str) -> list[int]:
        return list(self._table(seq_id))

    def reserve(self, seq_id: str, num_tokens: int) -> tuple[list[int], list[PageCopy]]:
        """Makes positions [num_committed, num_committed + num_tokens) writable: adds missing pages and
        copies each shared page among them (copy-on-write). Returns (slot_mapping [num_tokens], copies);
        the storage must apply the copies before writing the slots."""
        table = self._table(seq_id)
        if num_tokens < 0:
            raise InvalidRequest(f"num_tokens must be >= 0, got {num_tokens}")
        ps = self.page_size
        start = len(self._token_ids[seq_id])
        end = start + num_tokens
        shared = [i for i in self._pages_written(start, end) if i < len(table) and self._refcounts[table[i]] > 1]
        num_new_pages = max(0, self.pages_needed(end) - len(table))
        if len(shared) + num_new_pages > self.num_free_pages:
            raise KVPoolExhausted(
                f"{num_tokens} more tokens need {len(shared) + num_new_pages} free pages, {self.num_free_pages} left"
            )
        for i in self._pages_written(start, end):
            if i < len(table) and self._refcounts[table[i]] == 1 and table[i] in self._page_keys:
                del self._prefix_cache[self._page_keys.pop(table[i])]  # about to change: no longer that prefix
        copies = []
        for i in shared:
            dst_page = self._take_free_page()
            copies.append(PageCopy(src_page=table[i], dst_page=dst_page))
            self._refcounts[table[i]] -= 1  # was > 1: the other holders keep it
            table[i] = dst_page
        table.extend(self._take_free_page() for _ in range(num_new_pages))
        slot_mapping = [table[pos // ps] * ps + pos % ps for pos in range(start, end)]
        return slot_mapping, copies

    def commit(self, seq_id: str, token_ids: Sequence[int]) -> None:
        """Records that the KV of token_ids is written at the next positions, and puts every page this
        fills into the prefix cache."""
        table = self._table(seq_id)
        ps = self.page_size
        committed = self._token_ids[seq_id]
        start = len(committed)
        end = start + len(token_ids)
        if end > len(table) * ps:
            raise InvalidRequest(f"commit up to position {end} past the {len(table) * ps} reserved; reserve() first")
        if any(self._refcounts[table[i]] > 1 for i in self._pages_written(start, end)):
            raise InvalidRequest("commit into a shared page (forked since the last reserve()); reserve() first")
        committed.extend(token_ids)
        chain = self._chain_hashes[seq_id]
        for i in range(start // ps, end // ps):
            key = (chain[-1], tuple(committed[i * ps : (i + 1) * ps]))
            self._cache_page(key, table[i])
            chain.append(hash(key))

    def fork(self, parent_id: str, child_id: str, num_tokens: int | None = None) -> None:
        """The child shares the pages of the parent's first ``num_tokens`` committed tokens (None = all of
        them); whichever writes next into a shared partial page copies it first. Parent pages past those
        tokens stay the parent's alone."""
        table = self._table(parent_id)
        if child_id in self._block_tables:
            raise InvalidRequest(f"sequence {child_id!r} already exists")
        committed = self._token_ids[parent_id]
        num_tokens = len(committed) if num_tokens is None else num_tokens
        if not 0 <= num_tokens <= len(committed):
            raise InvalidRequest(f"fork of {num_tokens} tokens from {parent_id!r}, which has {len(committed)} committed")
        shared = table[: self.pages_needed(num_tokens)]
        for page in shared:
            self._refcounts[page] += 1
        self._block_tables[child_id] = shared
        self._token_ids[child_id] = committed[:num_tokens]
        self._chain_hashes[child_id] = self._chain_hashes[parent_id][: num_tokens // self.page_size + 1]

    def release(self, seq_id: str) -> None:
        """Drops the sequence; its pages nobody else holds become free, full ones still revivable."""
        table = self._table(seq_id)
        # Tail first, so it is reused first: a prefix hit on a page needs hits on all pages before it.
        for page in reversed(table):
            self._refcounts[page] -= 1
            if self._refcounts[page] == 0:
                free = self._free_cached_pages if page in self._page_keys else self._free_pages
                free[page] = None
        del self._block_tables[seq_id], self._token_ids[seq_id], self._chain_hashes[seq_id]

    def _table(self, seq_id: str) -> list[int]:
        table = self._block_tables.get(seq_id)
        if table is None:
            raise InvalidRequest(f"unknown sequence {seq_id!r}")
        return table

    def _pages_written(self, start: int, end: int) -> range:
        """Block-table indices that positions [start, end) fall in."""
        return range(start // self.page_size, self.pages_needed(end)) if end > start else range(0)

    def _take_free_page(self) -> int:
        if self._free_pages:
            page, _ = self._free_pages.popitem(last=False)
        else:
            page, _ = self._free_cached_pages.popitem(last=False)
            del self._prefix_cache[self._page_keys.pop(page)]  # its KV is about to be overwritten
        self._refcounts[page] = 1
        return page

    def _cache_page(self, key: PrefixKey, page: int) -> None:
        """Registers a just-filled page, unless a live page already holds the same prefix."""
        old_page = self._prefix_cache.get(key)
        if old_page is not None:
            if self._refcounts[old_page] > 0:
                return
            # The old holder is free: a hit on this live page costs no free page, reviving that one would.
            del self._page_keys[old_page]
            del self._free_cached_pages[old_page]
            self._free_pages[old_page] = None
        self._prefix_cache[key] = page
        self._page_keys[page] = key
