"""A drafting request whose prompt an earlier one of its client began: the draft takes the cached entries, the target
computes features only past them (and its own cached pages before them need no forward), and the tokens are Auto's.
The bundled tiny pair on the CPU."""

from __future__ import annotations

from typing import Iterator

import pytest

from diffspec.settings import BUNDLED_DRAFT, DiffSpecSettings
from draft_service.inprocess import load_draft_runtime
from draft_service.options import DraftOptions
from draft_service.runtime import DraftRuntime
from gateway.engine import SpeculativeEngine
from gateway.engine_core import EngineLimits
from gateway.request import GenerationRequest
from target_service.runtime import TargetRuntime
from tests.gateway.conftest import CODE_PROMPTS, assert_all_released, collect
from tests.gateway.recording import recording_engine
from tests.gateway.test_engine_core import long_prompt

FULL = DraftOptions("full", "16:0.0:4")
ONLINE = DraftOptions("online", "16:0.0:4", salience=True)
LIMITS = EngineLimits(max_requests=16, max_batch_tokens=4096, prefill_chunk=128)  # a prompt over several steps
PROMPT_TOKENS = 300  # 4 cached blocks of 64 entries: entry 255 pairs with token 256, the last usable


@pytest.fixture
def draft(tiny_target_dir) -> DraftRuntime:
    return load_draft_runtime(DiffSpecSettings(base_model=tiny_target_dir, draft_model=BUNDLED_DRAFT))


@pytest.fixture
def engine(tiny_target_dir, draft, tokenizer) -> Iterator[SpeculativeEngine]:
    target = TargetRuntime(DiffSpecSettings(base_model=tiny_target_dir, num_pages=256))
    engine = recording_engine(target, draft, tokenizer, LIMITS)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return long_prompt(tokenizer(CODE_PROMPTS[0])["input_ids"], PROMPT_TOKENS)


def _generated(engine: SpeculativeEngine, prompt: list[int], draft: DraftOptions | None, client: str) -> list[int]:
    return collect(engine, GenerationRequest(prompt, 24, draft=draft, client=client))[0]


def _computed_from(engine: SpeculativeEngine, session_id: str) -> int:
    """The first prompt position the target ran the forward of for ``session_id``."""
    for result in engine.target.results:
        if session_id in result.prefills and result.prefills[session_id].features is not None:
            done = result.prefills[session_id]
            return done.done_tokens - len(done.features)
    raise AssertionError(f"no features came back for {session_id}")


@pytest.mark.parametrize("options", [FULL, ONLINE])
def test_a_cached_prompt_starts_the_draft_from_its_entries_and_the_target_from_its_pages(engine, prompt, options):
    auto = _generated(engine, prompt, None, "tenant")
    first = _generated(engine, prompt, options, "tenant")
    again = _generated(engine, prompt, options, "tenant")
    assert first == again == auto
    opens = [o for _, batch in engine.target.batches for o in batch.opens if o.want_features]
    starts = [s for _, batch in engine.draft.batches for s in batch.starts]
    assert [o.features_from for o in opens] == [0, 256]
    assert [s.cached_positions for s in starts] == [0, 256]
    assert [len(s.features) for s in starts] == [PROMPT_TOKENS, PROMPT_TOKENS - 256]
    # the first drafting request computes every position for its features; the second only past the cache
    assert [_computed_from(engine, o.session_id) for o in opens] == [0, 256]
    assert_all_released(engine)


def test_another_client_finds_nothing(engine, prompt):
    _generated(engine, prompt, FULL, "tenant-a")
    _generated(engine, prompt, FULL, "tenant-b")
    opens = [o for _, batch in engine.target.batches for o in batch.opens]
    assert [o.features_from for o in opens] == [0, 0]
    assert_all_released(engine)


def test_a_request_that_never_starts_the_draft_leaves_no_pin(engine, prompt, draft):
    """One new token: the prompt's forward emits it and no draft session starts; its lookup's pin goes anyway."""
    _generated(engine, prompt, FULL, "tenant")
    assert _generated(engine, prompt, FULL, "tenant") and draft.prefix_cache.pinned_sessions == 0
    assert len(collect(engine, GenerationRequest(prompt, 1, draft=FULL, client="tenant"))[0]) == 1
    assert_all_released(engine)
