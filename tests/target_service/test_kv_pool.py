"""PagedKVPool: exact block ids, refcounts and slots on tiny pools, then a random-operation state machine
that checks the block manager against a fake KV storage."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from diffspec.errors import InvalidRequest, KVPoolExhausted
from target_service.kv_pool import PageCopy, PagedKVPool

PAGE_SIZE = 4


def snapshot(pool: PagedKVPool) -> tuple:
    """Everything a failed call must leave unchanged."""
    tables = {s: (pool.block_table(s), pool.committed_token_ids(s)) for s in pool.sequences()}
    return pool.num_free_pages, [pool.refcount(p) for p in range(pool.num_pages)], tables


def prefill(pool: PagedKVPool, seq_id: str, prompt_ids: list[int]) -> int:
    """Allocates a prompt and commits its uncached part, as the target's prefill does."""
    num_cached_tokens = pool.allocate(seq_id, prompt_ids)
    pool.reserve(seq_id, len(prompt_ids) - num_cached_tokens)
    pool.commit(seq_id, prompt_ids[num_cached_tokens:])
    return num_cached_tokens


# ---- slot arithmetic ----


@pytest.mark.parametrize(
    "prompt_len, num_tokens, expected_slots, expected_table",
    [
        (3, 1, [3], [0]),
        (4, 1, [4], [0, 1]),
        (3, 6, [3, 4, 5, 6, 7, 8], [0, 1, 2]),
        (5, 0, [], [0, 1]),
        (8, 4, [8, 9, 10, 11], [0, 1, 2]),
    ],
)
def test_reserve_after_prefill(prompt_len, num_tokens, expected_slots, expected_table):
    pool = PagedKVPool(num_pages=8, page_size=PAGE_SIZE)
    assert prefill(pool, "a", list(range(prompt_len))) == 0
    assert pool.reserve("a", num_tokens) == (expected_slots, [])
    assert pool.block_table("a") == expected_table
    assert pool.num_used_pages == len(expected_table)


def test_interleaved_sequences_get_scattered_slots():
    pool = PagedKVPool(num_pages=8, page_size=PAGE_SIZE)
    assert pool.allocate("a", [1, 2, 3]) == 0
    assert pool.allocate("b", [4, 5, 6]) == 0
    assert pool.reserve("a", 3) == ([0, 1, 2], [])
    assert pool.reserve("b", 3) == ([4, 5, 6], [])
    pool.commit("a", [1, 2, 3])
    pool.commit("b", [4, 5, 6])
    assert pool.reserve("a", 3) == ([3, 8, 9], [])  # offset 3 of page 0, then new page 2
    assert pool.reserve("b", 2) == ([7, 12], [])  # offset 3 of page 1, then new page 3
    pool.commit("a", [7, 8])
    assert pool.block_table("a") == [0, 2]
    assert pool.block_table("b") == [1, 3]
    assert pool.num_committed("a") == 5
    assert pool.committed_token_ids("a") == [1, 2, 3, 7, 8]
    assert (pool.num_free_pages, pool.num_used_pages) == (4, 4)


@pytest.mark.parametrize("num_tokens, expected", [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_pages_needed(num_tokens, expected):
    assert PagedKVPool(num_pages=8, page_size=PAGE_SIZE).pages_needed(num_tokens) == expected


# ---- prefix cache ----


def test_prefix_hit_shares_two_full_pages():
    pool = PagedKVPool(num_pages=8, page_size=PAGE_SIZE)
    prompt_a = list(range(1, 11))  # pages [1..4] [5..8] full, [9, 10] partial
    assert prefill(pool, "a", prompt_a) == 0
    assert pool.block_table("a") == [0, 1, 2]

    assert pool.allocate("b", prompt_a[:8] + [11, 12]) == 8
    assert pool.block_table("b") == [0, 1, 3]
    assert [pool.refcount(p) for p in range(4)] == [2, 2, 1, 1]
    assert pool.num_committed("b") == 8
    assert pool.committed_token_ids("b") == prompt_a[:8]
    assert pool.reserve("b", 2) == ([12, 13], [])


def test_partial_last_page_is_never_shared():
    pool = PagedKVPool(num_pages=8, page_size=PAGE_SIZE)
    prompt = [1, 2, 3, 4, 5, 6]
    prefill(pool, "a", prompt)
    assert pool.allocate("b", prompt) == 4
    assert pool.allocate("c", prompt + [7]) == 4
    assert pool.block_table("b") == [0, 2]
    assert pool.block_table("c") == [0, 3]
    assert [pool.refcount(p) for p in range(4)] == [3, 1, 1, 1]


@pytest.mark.parametrize(
    "prompt_len, expected_cached",
    [(1, 0), (4, 0), (5, 4), (8, 4), (9, 8), (12, 8), (13, 12)],
)
def test_last_prompt_token_is_never_cached(prompt_len, expected_cached):
    """Prompt prefixes of a 12-token sequence whose 3 pages are all cached (13: one token more)."""
    pool = PagedKVPool(num_pages=8, page_size=PAGE_SIZE)
    prompt_a = list(range(1, 13))
    prefill(pool, "a", prompt_a)
    prompt_b = (prompt_a + [99])[:prompt_len]
    assert pool.allocate("b", prompt_b) == expected_cached
    num_cached_pages = expected_cached // PAGE_SIZE
    num_new_pages = pool.pages_needed(prompt_len) - num_cached_pages
    assert pool.block_table("b") == [0, 1, 2][:num_cached_pages] + list(range(3, 3 + num_new_pages))


def test_released_full_pages_are_revived():
    pool = PagedKVPool(num_pages=8, page_size=PAGE_SIZE)
    prompt = list(range(1, 10))
    prefill(pool, "a", prompt)
    pool.release("a")
    assert pool.num_free_pages == 8

    assert pool.allocate("b", prompt) == 8
    assert pool.block_table("b") == [0, 1, 3]  # 0 and 1 revived; the new page is the oldest free unhashed one
    assert [pool.refcount(p) for p in range(4)] == [1, 1, 0, 1]
    assert pool.num_free_pages == 5


def test_handing_out_a_cached_page_drops_its_prefix():
    pool = PagedKVPool(num_pages=4, page_size=PAGE_SIZE)
    prompt_a = list(range(1, 10))
    prefill(pool, "a", prompt_a)
    pool.release("a")  # free: unhashed [3, 2], hashed [1, 0]
    assert pool.allocate("x", list(range(20, 28))) == 0
    assert pool.block_table("x") == [3, 2]  # unhashed pages go first

    assert pool.allocate("b", prompt_a[:5]) == 4
    assert pool.block_table("b") == [0, 1]  # page 1 handed out: its prefix entry is gone
    pool.release("x")
    pool.release("b")
    assert pool.allocate("d", prompt_a) == 4
    assert pool.block_table("d") == [0, 2, 3]


@pytest.mark.parametrize(
    "release_first_holder, expected_table_c, expected_refcounts",
    [
        (False, [0, 3], [2, 1, 1, 1]),  # page 0 is live: it keeps the entry, page 2 stays unregistered
        (True, [2, 3], [0, 0, 2, 1]),  # page 0 is free: the live page 2 takes the entry, no revival needed
    ],
)
def test_prefix_entry_prefers_a_live_page(release_first_holder, expected_table_c, expected_refcounts):
    pool = PagedKVPool(num_pages=8, page_size=PAGE_SIZE)
    prefill(pool, "a", [1, 2, 3, 4, 5])  # page 0 = [1, 2, 3, 4] registered
    if release_first_holder:
        pool.release("a")
    assert prefill(pool, "b", [1, 2, 3, 4]) == 0  # last token never cached: same KV again in page 2
    assert pool.block_table("b") == [2]
    assert pool.allocate("c", [1, 2, 3, 4, 9]) == 4
    assert pool.block_table("c") == expected_table_c
    assert [pool.refcount(p) for p in range(4)] == expected_refcounts


# ---- fork and copy-on-write ----


def test_fork_then_reserve_copies_the_partial_page_once():
    pool = PagedKVPool(num_pages=8, page_size=PAGE_SIZE)
    prefill(pool, "a", [1, 2, 3, 4, 5, 6])
    pool.fork("a", "c")
    assert pool.block_table("c") == [0, 1]
    assert pool.committed_token_ids("c") == [1, 2, 3, 4, 5, 6]
    assert [pool.refcount(p) for p in range(2)] == [2, 2]

    assert pool.reserve("c", 1) == ([10], [PageCopy(src_page=1, dst_page=2)])
    assert pool.block_table("c") == [0, 2]
    assert pool.block_table("a") == [0, 1]
    assert [pool.refcount(p) for p in range(3)] == [2, 1, 1]
    assert pool.reserve("a", 1) == ([6], [])  # page 1 is the parent's alone again
    assert pool.reserve("c", 1) == ([10], [])


def test_fork_shares_only_committed_pages():
    pool = PagedKVPool(num_pages=8, page_size=PAGE_SIZE)
    prefill(pool, "a", [1, 2, 3])
    pool.reserve("a", 6)  # pages [0, 1, 2], nothing past position 2 committed
    pool.fork("a", "c")
    assert pool.block_table("c") == [0]
    assert [pool.refcount(p) for p in range(3)] == [2, 1, 1]


def test_fork_of_a_prefix_shares_its_pages_and_caches_the_child_s_own_pages():
    pool = PagedKVPool(num_pages=8, page_size=PAGE_SIZE)
    prefill(pool, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # [0, 1, 2]: the parent decoded past the prompt
    pool.fork("a", "c", 5)  # positions 0-4: pages 0 and 1
    assert pool.block_table("c") == [0, 1] and pool.committed_token_ids("c") == [1, 2, 3, 4, 5]
    assert [pool.refcount(p) for p in range(3)] == [2, 2, 1]
    assert pool.reserve("c", 3) == ([13, 14, 15], [PageCopy(src_page=1, dst_page=3)])
    pool.commit("c", [6, 7, 0])  # fills page 3 with the chain after page 0
    pool.release("a")
    assert pool.allocate("d", [1, 2, 3, 4, 5, 6, 7, 0, 9]) == 8  # hits page 0, then the child's page 3
    assert pool.block_table("d")[:2] == [0, 3]
    with pytest.raises(InvalidRequest, match="fork of 9 tokens"):
        pool.fork("c", "e", 9)


def test_a_child_forked_mid_page_writes_into_a_cached_page_only_after_uncaching_it():
    pool = PagedKVPool(num_pages=8, page_size=PAGE_SIZE)
    prefill(pool, "a", [1, 2, 3, 4, 5])  # page 0 full and cached, page 1 holds position 4
    pool.fork("a", "c", 1)  # c's partial last page is a's full page 0
    pool.release("a")  # c alone holds page 0 now
    assert pool.reserve("c", 1) == ([1], [])  # written in place: nobody else reads it...
    pool.commit("c", [9])
    # ...and a prompt with a's first page no longer maps it: its position 1 holds c's token now
    assert pool.allocate("d", [1, 2, 3, 4, 5]) == 0
    assert 0 not in pool.block_table("d")


def test_commit_into_page_shared_since_reserve_is_refused():
    pool = PagedKVPool(num_pages=8, page_size=PAGE_SIZE)
    prefill(pool, "a", [1, 2, 3, 4, 5, 6])
    assert pool.reserve("a", 2) == ([6, 7], [])
    pool.fork("a", "c")  # page 1 shared: writing slot 6 now would change what c reads after a copy
    with pytest.raises(InvalidRequest):
        pool.commit("a", [7])
    assert pool.num_committed("a") == 6
    assert pool.reserve("a", 1) == ([10], [PageCopy(src_page=1, dst_page=2)])
    pool.commit("a", [7])
    assert pool.committed_token_ids("a") == [1, 2, 3, 4, 5, 6, 7]


# ---- exhaustion and release ----


def test_allocate_and_reserve_exhaustion_change_nothing():
    pool = PagedKVPool(num_pages=4, page_size=PAGE_SIZE)
    prefill(pool, "a", list(range(12)))
    before = snapshot(pool)
    assert not pool.can_allocate(8)
    with pytest.raises(KVPoolExhausted):
        pool.allocate("b", list(range(100, 108)))
    with pytest.raises(KVPoolExhausted):
        pool.reserve("a", 9)  # 21 positions: 2 new pages, 1 free
    assert snapshot(pool) == before
    assert not pool.has_sequence("b")
    assert pool.num_free_pages == 1


def test_copy_on_write_exhaustion_changes_nothing():
    pool = PagedKVPool(num_pages=4, page_size=PAGE_SIZE)
    prefill(pool, "a", list(range(13)))  # pages [0, 1, 2, 3], page 3 partial
    pool.fork("a", "c")
    before = snapshot(pool)
    with pytest.raises(KVPoolExhausted):
        pool.reserve("c", 1)
    assert snapshot(pool) == before
    assert pool.refcount(3) == 2


def test_release_returns_every_page():
    pool = PagedKVPool(num_pages=8, page_size=PAGE_SIZE)
    prompt_a = list(range(1, 11))
    prefill(pool, "a", prompt_a)  # [0, 1, 2]
    assert pool.allocate("b", prompt_a[:8] + [11, 12]) == 8  # [0, 1, 3]
    pool.fork("a", "c")  # [0, 1, 2]
    assert pool.reserve("c", 3) == ([18, 19, 20], [PageCopy(src_page=2, dst_page=4)])
    assert pool.block_table("c") == [0, 1, 4, 5]
    assert [pool.refcount(p) for p in range(6)] == [3, 3, 1, 1, 1, 1]

    for seq_id, expected_used in [("a", 5), ("c", 3), ("b", 0)]:
        pool.release(seq_id)
        assert pool.num_used_pages == expected_used
    assert pool.num_free_pages == 8
    assert all(pool.refcount(p) == 0 for p in range(8))
    assert pool.sequences() == []


# ---- misuse ----


@pytest.mark.parametrize(
    "misuse",
    [
        pytest.param(lambda pool: pool.reserve("ghost", 1), id="reserve-unknown"),
        pytest.param(lambda pool: pool.commit("ghost", [1]), id="commit-unknown"),
        pytest.param(lambda pool: pool.fork("ghost", "x"), id="fork-unknown-parent"),
        pytest.param(lambda pool: pool.release("ghost"), id="release-unknown"),
        pytest.param(lambda pool: pool.block_table("ghost"), id="block-table-unknown"),
        pytest.param(lambda pool: pool.num_committed("ghost"), id="num-committed-unknown"),
        pytest.param(lambda pool: pool.committed_token_ids("ghost"), id="token-ids-unknown"),
        pytest.param(lambda pool: pool.allocate("a", [1]), id="allocate-duplicate"),
        pytest.param(lambda pool: pool.fork("a", "b"), id="fork-onto-existing"),
        pytest.param(lambda pool: pool.allocate("c", []), id="allocate-empty-prompt"),
        pytest.param(lambda pool: pool.reserve("a", -1), id="reserve-negative"),
        pytest.param(lambda pool: pool.commit("a", [1] * 5), id="commit-past-reserved-pages"),
    ],
)
def test_misuse_raises_invalid_request_and_changes_nothing(misuse: Callable[[PagedKVPool], object]):
    pool = PagedKVPool(num_pages=8, page_size=PAGE_SIZE)
    pool.allocate("a", [1, 2, 3])
    pool.allocate("b", [4, 5])
    before = snapshot(pool)
    with pytest.raises(InvalidRequest):
        misuse(pool)
    assert snapshot(pool) == before


# ---- random operations against a fake KV storage ----

# fake KV of a position: its sequence's cache scope, then the token ids up to and including it (real KV depends
# on all of them; the scope stands for the tenant, whose pages another tenant must never read)
Kv = tuple[str | int, ...]
REJECTED: Kv = (-1,)  # what a rejected draft token leaves in its slot
SCOPES = ("alice", "mallory")


def fake_kv(token_ids: list[int], scope: str) -> list[Kv]:
    return [(scope, *token_ids[: pos + 1]) for pos in range(len(token_ids))]


class PoolMachine(RuleBasedStateMachine):
    """Prefill, decode steps with partial acceptance, fork and release on a 10-page pool with a
    3-token alphabet, so prefixes collide often; prompts come from two cache scopes, which must never
    read each other's pages."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = PagedKVPool(num_pages=10, page_size=PAGE_SIZE)
        self.storage: dict[int, Kv] = {}  # slot -> fake KV written there: the KV tensors' stand-in
        self.expected: dict[str, list[int]] = {}  # seq_id -> committed token ids
        self.scopes: dict[str, str] = {}  # seq_id -> cache scope
        self.seen_token_ids: list[list[int]] = []  # committed token ids of every sequence so far, to reuse as prefixes
        self.num_created = 0

    def _new_id(self) -> str:
        self.num_created += 1
        return f"s{self.num_created}"

    def _write(self, slots: list[int], copies: list[PageCopy], kvs: list[Kv]) -> None:
        for copy in copies:
            for offset in range(PAGE_SIZE):
                src = copy.src_page * PAGE_SIZE + offset
                if src in self.storage:
                    self.storage[copy.dst_page * PAGE_SIZE + offset] = self.storage[src]
        self.storage.update(zip(slots, kvs))

    @rule(prompt_ids=st.lists(st.integers(0, 2), min_size=1, max_size=12), scope=st.sampled_from(SCOPES))
    def prefill(self, prompt_ids: list[int], scope: str) -> None:
        seq_id = self._new_id()
        before = snapshot(self.pool)
        try:
            num_cached_tokens = self.pool.allocate(seq_id, prompt_ids, scope)
        except KVPoolExhausted:
            assert not self.pool.can_allocate(len(prompt_ids))
            assert snapshot(self.pool) == before
            return
        assert num_cached_tokens % PAGE_SIZE == 0
        assert num_cached_tokens <= (len(prompt_ids) - 1) // PAGE_SIZE * PAGE_SIZE
        assert self.pool.committed_token_ids(seq_id) == prompt_ids[:num_cached_tokens]
        slots, copies = self.pool.reserve(seq_id, len(prompt_ids) - num_cached_tokens)  # never fails
        assert copies == []
        self._write(slots, copies, fake_kv(prompt_ids, scope)[num_cached_tokens:])
        self.pool.commit(seq_id, prompt_ids[num_cached_tokens:])
        self.expected[seq_id] = list(prompt_ids)
        self.scopes[seq_id] = scope
        self.seen_token_ids.append(list(prompt_ids))

    @precondition(lambda self: self.seen_token_ids)
    @rule(data=st.data(), suffix=st.lists(st.integers(0, 2), max_size=4), scope=st.sampled_from(SCOPES))
    def prefill_seen_prefix(self, data: st.DataObject, suffix: list[int], scope: str) -> None:
        """A prompt that starts like an earlier sequence, live or released, of either scope: prefix hits
        and revivals in its own scope, none across."""
        token_ids = data.draw(st.sampled_from(self.seen_token_ids))
        prefix_len = data.draw(st.integers(0, len(token_ids)))
        if prefix_len + len(suffix) > 0:
            self.prefill(token_ids[:prefix_len] + suffix, scope)

    @precondition(lambda self: self.expected)
    @rule(data=st.data(), token_ids=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def decode_step(self, data: st.DataObject, token_ids: list[int]) -> None:
        """Writes a whole draft into the reserved slots, then commits only its accepted prefix."""
        seq_id = data.draw(st.sampled_from(sorted(self.expected)))
        before = snapshot(self.pool)
        try:
            slots, copies = self.pool.reserve(seq_id, len(token_ids))
        except KVPoolExhausted:
            assert snapshot(self.pool) == before
            return
        assert len(set(slots)) == len(slots)
        num_accepted = data.draw(st.integers(0, len(token_ids)))
        accepted = token_ids[:num_accepted]
        num_committed = len(self.expected[seq_id])
        kvs = fake_kv(self.expected[seq_id] + accepted, self.scopes[seq_id])[num_committed:]
        self._write(slots, copies, kvs + [REJECTED] * (len(token_ids) - num_accepted))
        self.pool.commit(seq_id, accepted)
        self.expected[seq_id] += accepted

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        """The whole parent, or a prefix of it (as n samples share their prompt while sample 0 decodes on)."""
        parent_id = data.draw(st.sampled_from(sorted(self.expected)))
        num_tokens = data.draw(st.none() | st.integers(0, len(self.expected[parent_id])))
        child_id = self._new_id()
        self.pool.fork(parent_id, child_id, num_tokens)
        self.expected[child_id] = self.expected[parent_id][:num_tokens]
        self.scopes[child_id] = self.scopes[parent_id]

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.expected)))
        self.pool.release(seq_id)
        self.seen_token_ids.append(self.expected.pop(seq_id))

    @invariant()
    def refcounts_match_block_tables(self) -> None:
        references = Counter(page for seq_id in self.pool.sequences() for page in self.pool.block_table(seq_id))
        assert [self.pool.refcount(p) for p in range(self.pool.num_pages)] == [
            references[p] for p in range(self.pool.num_pages)
        ]

    @invariant()
    def free_pages_are_the_unreferenced_ones(self) -> None:
        num_unreferenced = sum(self.pool.refcount(p) == 0 for p in range(self.pool.num_pages))
        assert self.pool.num_free_pages == num_unreferenced
        assert self.pool.num_free_pages + self.pool.num_used_pages == self.pool.num_pages

    @invariant()
    def every_sequence_reads_back_its_tokens(self) -> None:
        assert sorted(self.pool.sequences()) == sorted(self.expected)
        for seq_id, token_ids in self.expected.items():
            assert self.pool.committed_token_ids(seq_id) == token_ids
            table = self.pool.block_table(seq_id)
            slots = [table[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE for pos in range(len(token_ids))]
            assert [self.storage.get(slot) for slot in slots] == fake_kv(token_ids, self.scopes[seq_id])

    def teardown(self) -> None:
        for seq_id in self.pool.sequences():
            self.pool.release(seq_id)
        assert self.pool.num_free_pages == self.pool.num_pages


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
