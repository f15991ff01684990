"""Prefix-cache scopes: pages are shared only between sequences of one scope (tenant), with exact
block ids and refcounts, so one tenant's allocation can never confirm another tenant's prompt."""

from __future__ import annotations

from target_service.kv_pool import PagedKVPool

PAGE_SIZE = 4
PROMPT = list(range(1, 11))  # pages [1..4] [5..8] full, [9, 10] partial


def prefill(pool: PagedKVPool, seq_id: str, prompt_ids: list[int], scope: str) -> int:
    num_cached_tokens = pool.allocate(seq_id, prompt_ids, scope)
    pool.reserve(seq_id, len(prompt_ids) - num_cached_tokens)
    pool.commit(seq_id, prompt_ids[num_cached_tokens:])
    return num_cached_tokens


def test_the_same_scope_shares_full_pages():
    pool = PagedKVPool(num_pages=8, page_size=PAGE_SIZE)
    assert prefill(pool, "a", PROMPT, "alice") == 0
    assert pool.allocate("b", PROMPT, "alice") == 8
    assert pool.block_table("b") == [0, 1, 3]
    assert [pool.refcount(p) for p in range(4)] == [2, 2, 1, 1]


def test_another_scope_gets_no_hit_and_private_pages():
    pool = PagedKVPool(num_pages=8, page_size=PAGE_SIZE)
    prefill(pool, "a", PROMPT, "alice")
    assert pool.allocate("m", PROMPT, "mallory") == 0
    assert pool.block_table("m") == [3, 4, 5]
    assert [pool.refcount(p) for p in range(6)] == [1, 1, 1, 1, 1, 1]
    assert pool.num_committed("m") == 0


def test_the_default_scope_is_a_scope_of_its_own():
    pool = PagedKVPool(num_pages=16, page_size=PAGE_SIZE)
    prefill(pool, "a", PROMPT, "alice")
    assert pool.allocate("d", PROMPT) == 0 and pool.block_table("d") == [3, 4, 5]
    prefill(pool, "e", PROMPT, "")
    assert pool.block_table("e") == [6, 7, 8]
    assert pool.allocate("f", PROMPT, "") == 8 and pool.block_table("f") == [6, 7, 9]
    assert pool.allocate("g", PROMPT, "alice") == 8 and pool.block_table("g") == [0, 1, 10]


def test_a_freed_page_of_one_scope_is_not_revived_by_another():
    pool = PagedKVPool(num_pages=4, page_size=PAGE_SIZE)
    prefill(pool, "a", PROMPT, "alice")
    pool.release("a")  # pages 0 and 1 stay revivable for alice
    assert pool.allocate("m", PROMPT, "mallory") == 0
    # the never-used page, then alice's unhashed tail, then her oldest-freed cached page (1) is overwritten
    assert pool.block_table("m") == [3, 2, 1]
    assert [pool.refcount(p) for p in range(4)] == [0, 1, 1, 1]
    pool.release("m")
    assert pool.allocate("a2", PROMPT, "alice") == 4  # alice's first page survived; her second did not
    assert pool.block_table("a2") == [0, 1, 2]


def test_same_tokens_committed_in_two_scopes_are_cached_twice():
    pool = PagedKVPool(num_pages=8, page_size=PAGE_SIZE)
    prefill(pool, "a", PROMPT, "alice")
    prefill(pool, "m", PROMPT, "mallory")
    assert pool.block_table("a") == [0, 1, 2] and pool.block_table("m") == [3, 4, 5]
    assert pool.allocate("a2", PROMPT, "alice") == 8 and pool.block_table("a2")[:2] == [0, 1]
    assert pool.allocate("m2", PROMPT, "mallory") == 8 and pool.block_table("m2")[:2] == [3, 4]
    assert [pool.refcount(p) for p in range(6)] == [2, 2, 1, 2, 2, 1]
