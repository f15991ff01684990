"""What the draft runtime learns from an accept: the hazard profile observes a step only when the target
verified the draft's own last tree, not an Auto step taken in its stead (its proposal late)."""

from __future__ import annotations

import gc
import weakref

import torch

from diffspec.tree import DraftTree

from draft_service.backend import DraftAccept, DraftBatch, DraftStart
from draft_service.options import DraftOptions
from draft_service.runtime import DraftRuntime
from tests.draft_service.test_drafter import load_head


def test_an_accept_of_an_auto_step_leaves_the_hazard_profile_unchanged():
    runtime = DraftRuntime(load_head(torch.device("cpu"), torch.float32), cuda_graphs=False)
    c = runtime.head.config
    generator = torch.Generator().manual_seed(1)
    features = lambda rows: torch.randn(rows, 3 * c.target_hidden_size, generator=generator)  # noqa: E731
    prompt = torch.randint(0, c.vocab_size, (30,), generator=generator).tolist()
    start = DraftStart("s", prompt, features(len(prompt)), 1, DraftOptions("full", "16:0.0:4"))
    tree = runtime.step(DraftBatch(starts=[start], proposes=["s"])).trees["s"]
    hazard = runtime.sessions["s"].hazard
    skipped = DraftAccept("s", [7], features(1), verified_draft_tree=False)  # the tree came late: Auto ran
    tree = DraftTree.of(runtime.step(DraftBatch(accepts=[skipped], proposes=["s"])).trees["s"])
    assert hazard.steps == 0 and runtime.sessions["s"].drafter_state.num_entries == len(prompt) + 1
    verified = DraftAccept("s", [int(tree.tokens[1]), 2], features(2))  # the first child accepted, then a bonus
    runtime.step(DraftBatch(accepts=[verified], proposes=["s"]))
    assert hazard.steps == 1 and hazard.last_passed_ranks == [0]


def test_a_failed_accept_frees_its_session_at_once():
    """The failure a step returns keeps no frame, so nothing waits for the cyclic collector to free the
    session's draft KV and working set."""
    runtime = DraftRuntime(load_head(torch.device("cpu"), torch.float32), cuda_graphs=False)
    c = runtime.head.config
    prompt = list(range(30))
    start = DraftStart("s", prompt, torch.zeros(len(prompt), 3 * c.target_hidden_size), 1, DraftOptions("full", "16:0.0:4"))
    runtime.step(DraftBatch(starts=[start]))
    context = weakref.ref(runtime.sessions["s"].drafter_state.context)
    bad = DraftAccept("s", [c.vocab_size], torch.zeros(1, 3 * c.target_hidden_size))  # a token past the vocabulary
    gc.disable()
    try:
        result = runtime.step(DraftBatch(accepts=[bad]))
        assert "s" in result.failures and "s" not in runtime.sessions
        assert context() is None
    finally:
        gc.enable()
