"""A head of two decoder layers drafts what full causal recomputation gives, through prompts longer than an
ingestion chunk, batched accepts and the salience working set.

The oracle (``dense_reference_tree``) keeps no draft KV: each tree node's output is the last row of
``Eagle3Head.forward_dense`` over every committed entry plus the node's path.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import draft_service.drafter

from diffspec.tree import DraftTree
from draft_service.drafter import Drafter, DraftSession, Extension, ProposalRequest
from draft_service.eagle3_head import Eagle3Head
from draft_service.working_set import WorkingSetConfig
from tests.draft_service.reference_proposal import dense_reference_tree, reference_tree
from tests.draft_service.test_drafter import POLICIES
from tests.draft_service.test_eagle3_head import HIDDEN, VOCAB, random_head, small_config

SALIENCE = WorkingSetConfig(chunk_size=8, budget_tokens=48, sink_chunks=1, recent_chunks=2)  # 4 chunks of 8


@dataclass
class Committed:
    """A session and everything committed to it: entry t pairs features[t] with tokens[t]."""

    session: DraftSession
    tokens: list[int]
    features: torch.Tensor  # [entries, 3 * hidden]


def start(drafter: Drafter, length: int, generator: torch.Generator, salience: WorkingSetConfig | None) -> Committed:
    prompt = torch.randint(0, VOCAB, (length + 1,), generator=generator).tolist()
    features = torch.randn(length, 3 * HIDDEN, generator=generator)
    return Committed(drafter.start(prompt[:-1], features, prompt[-1], salience), prompt[1:], features)


def accept(drafter: Drafter, sessions: list[Committed], counts: tuple[int, ...], generator: torch.Generator) -> None:
    """One batched accept of ``counts[i]`` entries for session i."""
    extensions = []
    for committed, n in zip(sessions, counts):
        tokens = torch.randint(0, VOCAB, (n,), generator=generator).tolist()
        features = torch.randn(n, 3 * HIDDEN, generator=generator)
        extensions.append(Extension(committed.session, features, tokens))
        committed.tokens += tokens
        committed.features = torch.cat([committed.features, features])
    drafter.extend_many(extensions)


def assert_same_tree(got: DraftTree, want: DraftTree, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert got.tokens.tolist() == want.tokens.tolist()
    assert got.parents.tolist() == want.parents.tolist()
    torch.testing.assert_close(got.draft_probs, want.draft_probs, rtol=rtol, atol=atol)


def on_device(head: Eagle3Head, device: torch.device) -> Eagle3Head:
    """The same head, built on ``device`` (its rotary tables included)."""
    if device.type == "cpu":
        return head
    moved = Eagle3Head(head.config, head.embed_tokens.to(device))
    moved.load_state_dict(head.state_dict())
    return moved


@pytest.fixture
def small_chunks(monkeypatch) -> None:
    """Ingestion in chunks of 16 entries and lower-layer attention in pieces of 5 queries: a 40-entry prompt
    spans three chunks, and an accept's rows are split across pieces."""
    monkeypatch.setattr(draft_service.drafter, "EXTEND_CHUNK", 16)
    monkeypatch.setattr(draft_service.drafter, "ATTEND_CHUNK", 5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("policy", ["chain", "uniform3", "full-threshold", "online"])
def test_proposals_equal_dense_recomputation_through_accepts(small_chunks, policy, device):
    """Float32 on either device; on a GPU the proposal runs the Triton kernels (head_dim 16, their least) and is
    recorded as a CUDA graph (each shape's second proposal replays it)."""
    head = on_device(random_head(num_layers=2, head_dim=16), torch.device(device))
    drafter = Drafter(head, cuda_graphs=True)
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if device == "cuda" else {}
    generator = torch.Generator().manual_seed(11)
    sessions = [start(drafter, n, generator, None) for n in (3, 40, 23)]
    plan, budget = POLICIES[policy]
    for counts in ((2, 1, 6), (9, 3, 1), (1, 17, 4), None):  # 17: an accept longer than a chunk
        requests = [ProposalRequest(c.session, plan, budget) for c in sessions]
        for committed, request, tree in zip(sessions, requests, drafter.propose_many(requests)):
            assert committed.session.num_entries == len(committed.tokens)
            want = dense_reference_tree(head, request, committed.tokens, committed.features)
            assert_same_tree(tree, want, **tolerance)
        if counts is not None:
            accept(drafter, sessions, counts, generator)
    assert [c.session.num_entries for c in sessions] == [15, 61, 34]


def test_each_layer_attends_to_the_same_chunks_of_its_own_kv(small_chunks):
    """With salience the proposal equals the drafter's pieces over each layer's working set; every layer's
    arena holds the chunks selected on the last layer, and committing ignores the working set."""
    head = random_head(num_layers=2)
    drafter = Drafter(head, cuda_graphs=False)
    selected = [start(drafter, n, torch.Generator().manual_seed(n), SALIENCE) for n in (30, 90, 131)]
    whole = [start(drafter, n, torch.Generator().manual_seed(n), None) for n in (30, 90, 131)]
    generator = torch.Generator().manual_seed(12)
    accept(drafter, selected, (3, 1, 8), generator)
    accept(drafter, whole, (3, 1, 8), torch.Generator().manual_seed(12))
    for policy in ("full-threshold", "online"):
        requests = [ProposalRequest(c.session, *POLICIES[policy]) for c in selected]
        for request, tree in zip(requests, drafter.propose_many(requests)):
            assert_same_tree(tree, reference_tree(drafter, request))
    for committed, reference in zip(selected, whole):
        context = committed.session.context
        chunks = context.arenas[0].slot_chunk
        for layer in range(2):
            keys, values = context.committed(layer)
            assert torch.equal(keys, reference.session.context.committed(layer)[0])
            assert context.arenas[layer].slot_chunk == chunks
            assert context.covered_chunks <= context.index.num_chunks  # the set was chosen an accept ago
            tail = context.covered_chunks * SALIENCE.chunk_size  # every entry past its chunks is attended
            size = SALIENCE.chunk_size
            spans = [slice(c * size, (c + 1) * size) for c in chunks] + [slice(tail, None)]
            for got, held in zip(context.view(layer), (keys, values)):
                assert torch.equal(got, torch.cat([held[span] for span in spans]))
    assert selected[-1].session.context.attended_tokens < selected[-1].session.num_entries


def test_a_layer_that_adds_nothing_drafts_what_one_layer_drafts():
    """Layer 1 with zero o_proj and down_proj leaves the stream as layer 0 left it: the two-layer head's trees
    are the one-layer head's, so the root and every depth read the last layer's output."""
    shallow = random_head()
    deep = Eagle3Head(small_config(num_layers=2), shallow.embed_tokens)
    deep.load_state_dict({**random_head(num_layers=2, seed=1).state_dict(), **shallow.state_dict()})  # but layer 1
    with torch.no_grad():
        deep.layers["1"].self_attn.o_proj.weight.zero_()
        deep.layers["1"].mlp.down_proj.weight.zero_()
    one, two = Drafter(shallow, cuda_graphs=False), Drafter(deep, cuda_graphs=False)
    for policy in ("full", "online-threshold"):
        sessions = [[start(d, n, torch.Generator().manual_seed(n), None).session for n in (4, 33)] for d in (one, two)]
        trees = [d.propose_many([ProposalRequest(s, *POLICIES[policy]) for s in group])
                 for d, group in zip((one, two), sessions)]  # fmt: skip
        for got, want in zip(trees[1], trees[0]):
            assert_same_tree(got, want)
