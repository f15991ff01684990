"""The draft's prefix cache (``draft_service/prefix_cache.py``): keys that pair each entry with its next token, scopes,
pins against eviction, eviction tail first; and a session started from cached entries drafts as one started from
every feature."""

from __future__ import annotations

import pytest
import torch

from diffspec.errors import InvalidRequest
from diffspec.tree import DraftTree
from draft_service.backend import DraftBatch, DraftStart, PrefixLookup
from draft_service.draft_context import DraftContext
from draft_service.options import DraftOptions
from draft_service.prefix_cache import PREFIX_BLOCK_TOKENS, DraftPrefixCache
from draft_service.runtime import DraftRuntime
from tests.draft_service.test_drafter import load_head

BLOCK = 4
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 4


def _cache(blocks: int) -> DraftPrefixCache:
    return DraftPrefixCache(blocks * BLOCK, BLOCK, LAYERS, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))


def _context(entries: int, seed: int = 0) -> DraftContext:
    """A context of ``entries`` committed entries with seeded keys and values in every layer."""
    context = DraftContext(KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"), num_layers=LAYERS)
    generator = torch.Generator().manual_seed(seed)
    for keys, values in context.claim(entries):
        keys.copy_(torch.randn(keys.shape, generator=generator))
        values.copy_(torch.randn(values.shape, generator=generator))
    return context


def _stored(cache: DraftPrefixCache, tokens: list[int], scope: str = "", seed: int = 0) -> DraftContext:
    context = _context(len(tokens) - 1, seed)
    cache.store(scope, tokens, context)
    return context


TOKENS = list(range(100, 125))  # 24 entries: 6 blocks of 4


@pytest.mark.parametrize(
    "differs_at, blocks",
    [(0, 0), (1, 0), (4, 0), (5, 1), (8, 1), (9, 2), (24, 5), (None, 6)],
)  # block j's entries pair with tokens up to (j + 1) * 4: a change there is a change of block j
def test_a_lookup_finds_the_blocks_whose_tokens_all_agree(differs_at, blocks):
    cache = _cache(16)
    _stored(cache, TOKENS)
    prompt = TOKENS + [7]  # one more token: every stored block ends before the prompt's last position
    if differs_at is not None:
        prompt[differs_at] = 1
    assert cache.lookup("s", "", prompt) == blocks * BLOCK
    assert cache.hit_entries == blocks * BLOCK and cache.looked_up_entries == 6 * BLOCK


@pytest.mark.parametrize("prompt_tokens, entries", [(25, 24), (24, 20), (5, 4), (4, 0), (1, 0)])
def test_the_prompt_s_last_position_is_never_cached(prompt_tokens, entries):
    """Its entry pairs with the first generated token: the target computes it, and the draft writes it."""
    cache = _cache(16)
    _stored(cache, TOKENS)
    assert cache.lookup("s", "", TOKENS[:prompt_tokens]) == entries


def test_a_scope_sees_only_its_own_blocks():
    cache = _cache(16)
    _stored(cache, TOKENS, scope="tenant-a")
    assert cache.lookup("other", "tenant-b", TOKENS) == 0
    assert cache.lookup("default", "", TOKENS) == 0
    assert cache.lookup("same", "tenant-a", TOKENS) == 24


def test_load_copies_the_cached_entries_of_every_layer_and_unpins():
    cache = _cache(16)
    stored = _stored(cache, TOKENS)
    assert cache.lookup("s", "", TOKENS) == 24
    loaded = DraftContext(KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"), num_layers=LAYERS)
    assert cache.load("s", loaded, 12) == 12
    assert loaded.length == 12 and cache.pinned_sessions == 0
    for layer in range(LAYERS):
        for mine, theirs in zip(loaded.committed(layer), stored.committed(layer)):
            assert torch.equal(mine, theirs[:12])


@pytest.mark.parametrize("positions", [13, 28, -4])
def test_load_refuses_what_the_pin_does_not_hold(positions):
    cache = _cache(16)
    _stored(cache, TOKENS)
    cache.lookup("s", "", TOKENS)  # 24 pinned
    empty = DraftContext(KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"), num_layers=LAYERS)
    with pytest.raises(ValueError):
        cache.load("s", empty, positions)


def test_pinned_blocks_are_never_evicted_and_unpinned_chains_go_tail_first():
    cache = _cache(6)
    first = TOKENS[:17]  # 4 blocks
    _stored(cache, first, seed=1)
    assert cache.lookup("reader", "", first + [0]) == 16  # pins all 4
    other = [9] + TOKENS[1:17]  # another chain of 4 blocks: only the 2 free blocks take it
    assert cache.store("", other, _context(16, seed=2)) == 2
    assert cache.cached_blocks == 6
    cache.unpin("reader")
    assert cache.store("", other, _context(16, seed=2)) == 2  # its last 2 blocks: the first chain's 2 tail blocks
    assert cache.lookup("again", "", first + [0]) == 8  # its head survived
    assert cache.lookup("other", "", other + [0]) == 16


def test_storing_refreshes_a_chain_so_the_least_recent_goes_first():
    cache = _cache(4)
    a, b = TOKENS[:9], [5] + TOKENS[1:9]  # 2 blocks each
    _stored(cache, a)
    _stored(cache, b)
    _stored(cache, a)  # a is the most recent now
    _stored(cache, [6] + TOKENS[1:9])  # 2 more blocks: b's go
    assert cache.lookup("a", "", a + [0]) == 8
    assert cache.lookup("b", "", b + [0]) == 0


def test_a_session_cannot_hold_two_pins():
    cache = _cache(4)
    cache.lookup("s", "", TOKENS)
    with pytest.raises(ValueError):
        cache.lookup("s", "", TOKENS)


# -- the runtime ----------------------------------------------------------------------------------------------


def _runtime(cache_tokens: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> DraftRuntime:
    head = load_head(torch.device(device), dtype)
    return DraftRuntime(head, cuda_graphs=device != "cpu", prefix_cache_tokens=cache_tokens)


def _prompt(runtime: DraftRuntime, length: int, seed: int) -> tuple[list[int], torch.Tensor]:
    c, weight = runtime.head.config, runtime.head.fc.weight
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, c.vocab_size, (length,), generator=generator).tolist()
    features = torch.randn(length, 3 * c.target_hidden_size, generator=generator)
    return ids, features.to(weight.device, weight.dtype)


@pytest.mark.parametrize(
    "salience, device, dtype",
    [
        (False, "cpu", torch.float32),
        (True, "cpu", torch.float32),
        pytest.param(True, "cuda", torch.bfloat16, marks=pytest.mark.gpu),  # graphs, uploads without a sync
    ],
)
def test_a_session_started_from_cached_entries_drafts_as_one_started_from_every_feature(salience, device, dtype):
    """A first request's prompt is cached when it ends; a second shares its first 150 tokens: it takes the two
    blocks whose tokens all agree and the features of the rest, and its context and trees are the fresh start's."""
    options = DraftOptions("full", "24:0.0:5", salience=salience)
    cached_runtime, fresh_runtime = _runtime(4096, device, dtype), _runtime(0, device, dtype)
    first_ids, first_features = _prompt(cached_runtime, 300, seed=1)
    second_ids, second_features = _prompt(cached_runtime, 320, seed=2)
    second_ids[:150], second_features[:150] = first_ids[:150], first_features[:150]

    cached_runtime.step(DraftBatch(lookups=[PrefixLookup("first", first_ids)]))
    cached_runtime.step(DraftBatch(starts=[DraftStart("first", first_ids, first_features, 3, options)]))
    first_entries = [t.clone() for t in cached_runtime.sessions["first"].drafter_state.context.committed(0)]
    cached_runtime.step(DraftBatch(releases=["first"]))
    looked_up = cached_runtime.step(DraftBatch(lookups=[PrefixLookup("second", second_ids)]))
    hit = looked_up.cached["second"]
    assert hit == 2 * PREFIX_BLOCK_TOKENS  # entry 127 pairs with token 128 < 150; entry 191 with 192 > 150
    start = DraftStart("second", second_ids, second_features[hit:], 5, options, cached_positions=hit)
    from_cache = cached_runtime.step(DraftBatch(starts=[start], proposes=["second"]))
    fresh = fresh_runtime.step(
        DraftBatch(starts=[DraftStart("second", second_ids, second_features, 5, options)], proposes=["second"])
    )

    assert not from_cache.failures and not fresh.failures
    mine, theirs = cached_runtime.sessions["second"].drafter_state, fresh_runtime.sessions["second"].drafter_state
    assert mine.token_ids == theirs.token_ids == [*second_ids, 5]
    assert all(torch.equal(m[:hit], f[:hit]) for m, f in zip(mine.context.committed(0), first_entries))  # copies
    assert cached_runtime.prefix_cache.pinned_sessions == 0
    if dtype == torch.float32:  # a bf16 GPU's matmuls may round a row differently in a batch of another size
        torch.testing.assert_close(mine.context.committed(0), theirs.context.committed(0), rtol=1e-5, atol=1e-5)
        assert DraftTree.of(from_cache.trees["second"]).token_list() == DraftTree.of(fresh.trees["second"]).token_list()


def test_a_released_session_leaves_its_generated_entries_for_the_next_turn():
    """The next turn's prompt is the last one's prompt and answer: the blocks of both are found."""
    runtime = _runtime(4096)
    ids, features = _prompt(runtime, 100, seed=3)
    runtime.step(DraftBatch(lookups=[PrefixLookup("turn-1", ids)]))
    runtime.step(DraftBatch(starts=[DraftStart("turn-1", ids, features, 7, DraftOptions("full", "16:0.0:4"))]))
    session = runtime.sessions["turn-1"].drafter_state
    runtime.drafter.extend(session, torch.randn(40, features.shape[1]), list(range(1, 41)))  # an answer of 41 tokens
    runtime.step(DraftBatch(releases=["turn-1"]))
    next_turn = [*ids, 7, *range(1, 41), 99, 98]
    assert runtime.step(DraftBatch(lookups=[PrefixLookup("turn-2", next_turn)])).cached["turn-2"] == 128  # 141 entries


def test_a_start_claiming_more_than_its_lookup_pinned_fails_alone_and_every_pin_goes():
    runtime = _runtime(4096)
    ids, features = _prompt(runtime, 200, seed=4)
    options = DraftOptions("full", "16:0.0:4")
    runtime.step(DraftBatch(lookups=[PrefixLookup("a", ids)]))
    runtime.step(DraftBatch(starts=[DraftStart("a", ids, features, 1, options)]))
    runtime.step(DraftBatch(releases=["a"]))  # 192 entries cached
    lookups = [PrefixLookup(sid, ids) for sid in "bcde"]
    assert runtime.step(DraftBatch(lookups=lookups)).cached == {"b": 192, "c": 192, "d": 192, "e": 192}
    assert runtime.prefix_cache.pinned_sessions == 4
    too_many = DraftStart("b", ids, features[199:], 1, options, cached_positions=199)
    wrong_rows = DraftStart("c", ids, features, 1, options, cached_positions=64)
    part_block = DraftStart("e", ids, features[65:], 1, options, cached_positions=65)
    failed = runtime.step(DraftBatch(starts=[too_many, wrong_rows, part_block], releases=["d"]))
    assert set(failed.failures) == {"b", "c", "e"}
    assert all(isinstance(f, InvalidRequest) for f in failed.failures.values())
    assert runtime.prefix_cache.pinned_sessions == 0 and not runtime._lookup_scopes


def test_without_a_cache_lookups_find_nothing_and_starts_claim_nothing():
    runtime = _runtime(0)
    ids, features = _prompt(runtime, 200, seed=5)
    assert runtime.prefix_cache is None
    assert runtime.step(DraftBatch(lookups=[PrefixLookup("a", ids)])).cached == {"a": 0}
    start = DraftStart("a", ids, features[64:], 1, DraftOptions("full", "16:0.0:4"), cached_positions=64)
    assert isinstance(runtime.step(DraftBatch(starts=[start])).failures["a"], InvalidRequest)
