"""bench.prefix_reuse on the bundled pair (CPU): the warm requests take the prompt from the draft's prefix cache and
emit the cold ones' tokens, which are Auto's; the row counts every run."""

from __future__ import annotations

import itertools

from bench.prefix_reuse import one_prompt
from diffspec.settings import DiffSpecSettings
from gateway.assembly import build_engine
from tests.conftest import CODE_PROMPTS


def test_a_warm_prompt_and_its_next_turn_are_found_and_emit_the_cold_tokens():
    engine = build_engine(DiffSpecSettings(num_pages=256))
    try:
        ids = engine.tokenizer(CODE_PROMPTS[0])["input_ids"]
        prompt = [ids[0], *itertools.islice(itertools.cycle(ids[1:]), 299)]
        cache = engine.draft.prefix_cache
        row = one_prompt(engine, prompt, ids[1:33], 40)
        # the warm prompt finds 4 blocks (entries to 255), its next turn at least those (its answer may fill more);
        # the cold requests, each a client of its own, find nothing
        found = {name: run["draft_cached_entries"] for name, run in row["runs"].items()}
        assert found["warm"] == 4 * 64 and found["turn_warm"] >= 4 * 64
        assert found["auto"] == found["cold"] == found["turn_cold"] == 0
        assert cache.hit_entries >= sum(found.values()) and cache.looked_up_entries > cache.hit_entries
        assert row["cold_equals_auto"] and row["warm_equals_cold"] and row["turn_warm_equals_cold"]
        assert set(row["runs"]) == {"auto", "cold", "warm", "turn_cold", "turn_warm"}
        assert row["prompt_tokens"] == 300 and 300 + 32 < row["next_turn_tokens"] <= 300 + 40 + 32
    finally:
        engine.close()
