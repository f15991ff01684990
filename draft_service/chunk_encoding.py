"""Salience encodings of the draft's contexts: per chunk and KV head, the min and max key.

Every session of a drafter keeps its encodings in one pool, a page of ``page_chunks`` chunks at a time,
so one launch scores a whole batch (``diffspec_kernels/chunk_scoring_triton.py``) and a chunk that fills
costs a row written, not the session's encodings copied. A session's ``ChunkIndex`` holds its pages in
order; the pool doubles when it runs out of pages and takes a session's pages back when its index is
collected: a session ends by being dropped (``runtime.py``), and nothing else refers to its index.

An index grows with the draft KV: only chunks that became full since it last grew are encoded, so
the cost per step is O(new tokens), and the encodings take 2/chunk_size of the keys' memory.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from diffspec.devices import PinnedStaging
from diffspec_kernels.chunk_scoring_ref import chunk_scores_reference
from diffspec_kernels.dispatch import triton_kernels_on

PAGE_CHUNKS = 64  # chunks a page: at 64-token chunks, 4K tokens of context


@dataclass(frozen=True)
class ChunkScores:
    """A scoring launch's scores, with the ints that went up for it, for what the caller computes from them."""

    scores: torch.Tensor  # [rows, width] float32 upper bounds of q . k per chunk, -inf past each row's chunks
    num_chunks: torch.Tensor  # [rows] int64 chunks each row scored
    along: torch.Tensor  # [len(along)] int64 the caller's ints, in the scoring's upload


def _scorer(device: torch.device):  # noqa: ANN202 - one of two functions of the same signature
    """The Triton scorer for a GPU's keys, else the PyTorch reference."""
    if not triton_kernels_on(device):
        return chunk_scores_reference
    from diffspec_kernels.chunk_scoring_triton import chunk_scores_triton

    return chunk_scores_triton


class ChunkEncodingPool:
    """The encodings of every session's chunks of ``chunk_size`` tokens, in pages handed out to sessions."""

    def __init__(
        self,
        chunk_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        staging: PinnedStaging | None = None,
        page_chunks: int = PAGE_CHUNKS,
    ) -> None:
        """``staging``: where the page tables and new rows go up, shared with the drafter's other uploads."""
        self.chunk_size = chunk_size
        shape = (0, page_chunks, num_kv_heads, head_dim)
        self.key_min = torch.empty(shape, dtype=dtype, device=device)  # [pages, page_chunks, kv_heads, hd]
        self.key_max = torch.empty(shape, dtype=dtype, device=device)  # [pages, page_chunks, kv_heads, hd]
        self.free_pages: list[int] = []  # taken from the end
        self.staging = staging or PinnedStaging(device)
        self._score = _scorer(device)

    @property
    def page_chunks(self) -> int:
        return self.key_min.shape[1]

    @property
    def num_pages(self) -> int:
        return self.key_min.shape[0]

    @property
    def live_pages(self) -> int:
        """Pages some session holds."""
        return self.num_pages - len(self.free_pages)

    def allocate(self, n: int) -> list[int]:
        """``n`` free pages, the pool doubled first if it has too few (the pages held keep their ids). Pages
        are taken one pop at a time and added in place: a dropped session's pages may come back in the middle
        (its finalizer runs wherever the collector does)."""
        if n > len(self.free_pages):
            held = self.num_pages
            grown = max(2 * held, held + n - len(self.free_pages))
            self.key_min, self.key_max = _grown(self.key_min, grown), _grown(self.key_max, grown)
            self.free_pages[:0] = range(grown - 1, held - 1, -1)
        return [self.free_pages.pop() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self.free_pages += pages

    def encode_and_score(
        self,
        indexes: list[ChunkIndex],
        keys: list[torch.Tensor],
        lengths: list[int],
        queries: torch.Tensor,
        query_rows: list[int] | None = None,
        along: list[int] | None = None,
    ) -> ChunkScores:
        """Encode every index's chunks that filled since it last grew, from its session's first lengths[i] keys,
        which keys[i] [at least lengths[i], kv_heads, hd] begins with (one min and one max for the batch; nothing
        for a session with no new full chunk); then score them (``ChunkScores``): [len(indexes), widest page
        table * page_chunks] float32 upper bounds of q . k per chunk, -inf past each index's chunks, for
        queries[query_rows[i]] (``queries`` [any, heads, hd]; None: the first len(indexes) rows in order). The new
        chunks' pool rows, the page table, the query rows and the caller's ``along`` ints go up in one upload,
        and the scoring is one launch."""
        chunks, rows = self._filled(indexes, keys, lengths)
        table = _page_table(indexes)  # after ``_filled``: it holds the pages the new chunks took
        picks, extra = query_rows or [], along or []
        ids = self.staging.upload(rows, table, picks, extra)
        sizes = [len(rows), len(table) - len(indexes), len(indexes), len(picks), len(extra)]
        at, page_table, num_chunks, picked, extra_up = ids.split(sizes)
        if rows:
            self._write(chunks, at)
        if query_rows is not None:
            queries = queries.index_select(0, picked)
        return ChunkScores(self._scored(queries, page_table, num_chunks), num_chunks, extra_up)

    def _filled(
        self, indexes: list[ChunkIndex], keys: list[torch.Tensor], lengths: list[int]
    ) -> tuple[torch.Tensor | None, list[int]]:
        """The chunks [new chunks, chunk_size, kv_heads, hd] that filled since each index last grew (None: none),
        and the pool rows [new chunks] they go to; the indexes grow to hold them."""
        fresh, rows = [], []
        for index, session_keys, length in zip(indexes, keys, lengths):
            full = length // self.chunk_size
            if full <= index.num_chunks:
                continue
            new = session_keys[index.num_chunks * self.chunk_size : full * self.chunk_size]
            fresh.append(new.view(full - index.num_chunks, self.chunk_size, *new.shape[1:]))
            rows += index.grow(full)
        if not fresh:
            return None, rows
        return (fresh[0] if len(fresh) == 1 else torch.cat(fresh)), rows

    def _write(self, chunks: torch.Tensor, at: torch.Tensor) -> None:
        """Encode ``chunks`` [new chunks, chunk_size, kv_heads, hd] into pool rows ``at`` [new chunks] (device)."""
        self.key_min.view(-1, *self.key_min.shape[2:]).index_copy_(0, at, chunks.amin(1))
        self.key_max.view(-1, *self.key_max.shape[2:]).index_copy_(0, at, chunks.amax(1))

    def _scored(self, queries: torch.Tensor, page_table: torch.Tensor, num_chunks: torch.Tensor) -> torch.Tensor:
        """One scoring launch over the uploaded ``_page_table``: page_table [batch * widest], num_chunks [batch]."""
        return self._score(queries, self.key_min, self.key_max, page_table.view(num_chunks.shape[0], -1), num_chunks)


def _page_table(indexes: list[ChunkIndex]) -> list[int]:
    """What a scoring launch uploads: each index's pages, padded with page 0 to the widest [batch, widest], then
    each index's chunks [batch]; host ints (a few dozen of them: a list beats numpy at this size)."""
    widest = max(len(index.pages) for index in indexes)
    table = [page for index in indexes for page in (*index.pages, *[0] * (widest - len(index.pages)))]
    return [*table, *(index.num_chunks for index in indexes)]


class ChunkIndex:
    """One session's encodings: the pool pages that hold them, in chunk order, and how many chunks they hold."""

    def __init__(self, pool: ChunkEncodingPool) -> None:
        """``pool``: where the encodings live, shared with the other sessions of a batch."""
        self.pool = pool
        self.pages: list[int] = []  # [ceil(num_chunks / page_chunks)] pool page of each page of chunks
        self.num_chunks = 0
        weakref.finalize(self, self.pool.free, self.pages)  # the pages go back when the session is dropped

    def grow(self, num_chunks: int) -> list[int]:
        """Hold ``num_chunks`` chunks; the pool rows [new chunks] of the ones added, for the caller to fill."""
        page_chunks = self.pool.page_chunks
        self.pages += self.pool.allocate(-(-num_chunks // page_chunks) - len(self.pages))
        added = range(self.num_chunks, num_chunks)
        self.num_chunks = num_chunks
        return [self.pages[chunk // page_chunks] * page_chunks + chunk % page_chunks for chunk in added]


def _grown(pages: torch.Tensor, num_pages: int) -> torch.Tensor:
    grown = torch.empty(num_pages, *pages.shape[1:], dtype=pages.dtype, device=pages.device)
    grown[: pages.shape[0]] = pages
    return grown
