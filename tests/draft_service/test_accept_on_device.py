"""Entries written from a verify's device acceptance, then settled by the host's: the state an ordinary accept
leaves, whichever way the check goes, and nothing waits for the GPU while they are written."""

from __future__ import annotations

import pytest
import torch

from diffspec.device_accept import DeviceAccept
from draft_service.drafter import DeviceExtension, Drafter, DraftSession, Extension, ProposalRequest
from tests.draft_service.reference_proposal import root_output
from tests.draft_service.test_drafter import (
    CONTEXT_LENGTHS,
    POLICIES,
    SALIENCE,
    graphed_and_eager,
    host_waits,
    load_head,
    start_sessions,
)
from tests.host_reads import host_reads

COUNTS = (1, 4, 2, 6)  # entries each session's accept commits
MAX_ENTRIES = (3, 6, 2, 9)  # rows the device wrote for it: its tree's depth bound + 1


def _accepts(drafter: Drafter, seed: int) -> list[tuple[torch.Tensor, list[int]]]:
    """(features [max_entries, 3 * hidden], emitted tokens) per session: the real rows first, padding after them
    repeating the last, as the target's device acceptance pads them."""
    c, device = drafter.head.config, drafter.head.fc.weight.device
    generator = torch.Generator().manual_seed(seed)
    accepts = []
    for n, rows in zip(COUNTS, MAX_ENTRIES):
        features = torch.randn(rows, 3 * c.target_hidden_size, generator=generator)
        features[n:] = features[n - 1]
        tokens = torch.randint(0, c.vocab_size, (n,), generator=generator).tolist()
        accepts.append((features.to(device), tokens))
    return accepts


def _device_accept(features: torch.Tensor, tokens: list[int], rows: int) -> DeviceAccept:
    padded = torch.tensor(tokens + [tokens[-1]] * (rows - len(tokens)), device=features.device)
    return DeviceAccept(features, padded, torch.tensor(len(tokens), device=features.device), rows)


def _extensions(sessions: list[DraftSession], accepts: list[tuple[torch.Tensor, list[int]]]) -> list[DeviceExtension]:
    return [DeviceExtension(s, _device_accept(f, t, rows)) for s, (f, t), rows in zip(sessions, accepts, MAX_ENTRIES)]


def _assert_same_sessions(drafter: Drafter, got: list[DraftSession], want: list[DraftSession]) -> None:
    for a, b in zip(got, want):
        assert (a.num_entries, a.root_token, a.unsettled) == (b.num_entries, b.root_token, None)
        assert a.context.length == b.context.length == a.num_entries
        for layer in range(drafter.head.config.num_layers):
            torch.testing.assert_close(a.context.view(layer)[0], b.context.view(layer)[0])
        torch.testing.assert_close(root_output(drafter, a), root_output(drafter, b), rtol=1e-5, atol=1e-5)
    plan, budget = POLICIES["full"]
    trees = [drafter.propose_many([ProposalRequest(s, plan, budget) for s in sessions]) for sessions in (got, want)]
    for a, b in zip(*trees):
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()


@pytest.fixture(scope="module", params=[1, 2], ids=["one layer", "two layers"])
def drafter(request) -> Drafter:
    return Drafter(load_head(torch.device("cpu"), torch.float32, request.param), cuda_graphs=False)


@pytest.mark.parametrize("salience", [None, SALIENCE], ids=["full-context", "salience"])
def test_settled_device_entries_equal_an_ordinary_accept(drafter, salience):
    early, ordinary = (start_sessions(drafter, CONTEXT_LENGTHS, salience, seed=2) for _ in range(2))
    for round_ in range(3):  # the working set re-chosen between rounds, from the settled accepts' scores
        accepts = _accepts(drafter, seed=round_)
        drafter.extend_on_device(_extensions(early, accepts))
        assert all(s.unsettled is not None and s.context.length == s.num_entries + rows
                   for s, rows in zip(early, MAX_ENTRIES))  # fmt: skip
        drafter.commit_accepted([Extension(s, f[: len(t)], t) for s, (f, t) in zip(early, accepts)])
        drafter.extend_many([Extension(s, f[: len(t)], t) for s, (f, t) in zip(ordinary, accepts)])
        _assert_same_sessions(drafter, early, ordinary)


@pytest.mark.parametrize("salience", [None, SALIENCE], ids=["full-context", "salience"])
@pytest.mark.parametrize("policy", ["full", "full-threshold"])
def test_a_proposal_from_unsettled_entries_grows_the_settled_session_s_trees(drafter, salience, policy):
    """Queued before the host knows the acceptance, a proposal takes its root, entry count and context length
    from the device: the trees a proposal after the settled accept grows, round after round."""
    ahead, ordinary = (start_sessions(drafter, CONTEXT_LENGTHS, salience, seed=6) for _ in range(2))
    plan, budget = POLICIES[policy]
    for round_ in range(3):
        accepts = _accepts(drafter, seed=10 + round_)
        drafter.extend_on_device(_extensions(ahead, accepts))
        early = drafter.propose_pending([ProposalRequest(s, plan, budget) for s in ahead])
        drafter.commit_accepted([Extension(s, f[: len(t)], t) for s, (f, t) in zip(ahead, accepts)])
        drafter.extend_many([Extension(s, f[: len(t)], t) for s, (f, t) in zip(ordinary, accepts)])
        settled = drafter.propose_many([ProposalRequest(s, plan, budget) for s in ordinary])
        for pending, want, (_, tokens) in zip(early, settled, accepts):
            got = pending.tree()
            assert int(got.tokens[0]) == tokens[-1]  # the root: the last emitted token, found on the device
            assert got.tokens.tolist() == want.tokens.tolist() and got.parents.tolist() == want.parents.tolist()
            torch.testing.assert_close(got.draft_probs, want.draft_probs, rtol=1e-5, atol=1e-6)


def test_a_proposal_mixing_settled_and_unsettled_sessions_or_growing_no_depth_from_them_is_refused(drafter):
    sessions = start_sessions(drafter, CONTEXT_LENGTHS[:2], None, seed=8)
    accepts = _accepts(drafter, seed=4)[:1]
    drafter.extend_on_device(_extensions(sessions[:1], accepts))
    plan, budget = POLICIES["full"]
    with pytest.raises(ValueError, match="all settled or all unsettled"):
        drafter.propose_pending([ProposalRequest(s, plan, budget) for s in sessions])
    with pytest.raises(ValueError, match="root on the host"):  # a root-only tree's root would be the stale one
        drafter.propose_pending([ProposalRequest(sessions[0], [], budget)])


def test_a_proposal_from_unsettled_entries_reads_no_value_back(drafter):
    """The CPU's view of queueing it behind the verify: nothing of the acceptance comes to the host."""
    sessions = start_sessions(drafter, CONTEXT_LENGTHS, None, seed=3)
    plan, budget = POLICIES["full"]
    requests = [ProposalRequest(s, plan, budget) for s in sessions]
    drafter.extend_on_device(_extensions(sessions, _accepts(drafter, seed=2)))
    drafter.propose_pending(requests)  # the shape's buffers allocated
    assert host_reads(lambda: drafter.propose_pending(requests)) == []


def test_entries_the_host_did_not_accept_are_replaced_by_its_own(drafter):
    """The device's tokens or count differ from the host's acceptance (which decides): the session is extended
    with the host's entries instead, as if nothing had been written."""
    early, ordinary = (start_sessions(drafter, CONTEXT_LENGTHS, None, seed=5) for _ in range(2))
    accepts = _accepts(drafter, seed=7)
    wrong = []
    for i, ((features, tokens), rows) in enumerate(zip(accepts, MAX_ENTRIES)):
        device_tokens = [t + 1 for t in tokens] if i % 2 else tokens[:-1] or [tokens[0] + 1]  # other tokens, fewer
        wrong.append(DeviceExtension(early[i], _device_accept(features, device_tokens, rows)))
    drafter.extend_on_device(wrong)
    drafter.commit_accepted([Extension(s, f[: len(t)], t) for s, (f, t) in zip(early, accepts)])
    drafter.extend_many([Extension(s, f[: len(t)], t) for s, (f, t) in zip(ordinary, accepts)])
    _assert_same_sessions(drafter, early, ordinary)


def test_discarding_restores_the_session_and_a_second_write_before_settling_is_refused(drafter):
    sessions = start_sessions(drafter, CONTEXT_LENGTHS[:2], None, seed=9)
    before = [(s.num_entries, s.context.length, s.root_query.clone(), s.root_hidden.clone()) for s in sessions]
    accepts = _accepts(drafter, seed=3)[:2]
    extensions = _extensions(sessions, accepts)
    drafter.extend_on_device(extensions)
    with pytest.raises(ValueError, match="not settled"):
        drafter.extend_on_device(extensions)
    for session, (entries, length, query, hidden) in zip(sessions, before):
        drafter.discard_unsettled(session)
        assert (session.num_entries, session.context.length, session.unsettled) == (entries, length, None)
        assert torch.equal(session.root_query, query) and torch.equal(session.root_hidden, hidden)


@pytest.mark.parametrize("salience", [None, SALIENCE], ids=["full-context", "salience"])
def test_writing_entries_on_the_device_reads_no_value_back(drafter, salience):
    """The CPU's view of the GPU test below: no op of the write reads a tensor's value to the host."""
    sessions = start_sessions(drafter, CONTEXT_LENGTHS, salience, seed=4)
    for seed in (1, 2):  # the second round takes a working set the first one's scores chose
        accepts = _accepts(drafter, seed=seed)
        extensions = _extensions(sessions, accepts)
        assert host_reads(lambda: drafter.extend_on_device(extensions)) == []
        drafter.commit_accepted([Extension(s, f[: len(t)], t) for s, (f, t) in zip(sessions, accepts)])


@pytest.mark.gpu
@pytest.mark.parametrize("salience", [None, SALIENCE], ids=["full-context", "salience"])
def test_writing_entries_on_the_device_never_waits_for_the_gpu(salience):
    """Inputs go up through pinned memory, the last real row is picked by a device index, and the check's copy is
    queued: the host only launches. (A session with a working set to take reads its scores' copy, queued behind
    the proposal before the verify: these sessions have none queued.) The second round is the one measured: the
    first compiles kernels and allocates the pinned buffers a process keeps."""
    drafter = Drafter(load_head(torch.device("cuda"), torch.bfloat16), cuda_graphs=False)
    sessions = start_sessions(drafter, CONTEXT_LENGTHS, salience)
    waits = []
    for seed in (1, 2):
        accepts = [(f.bfloat16(), t) for f, t in _accepts(drafter, seed=seed)]
        extensions = _extensions(sessions, accepts)
        waits = host_waits(lambda: drafter.extend_on_device(extensions))
        drafter.commit_accepted([Extension(s, f[: len(t)], t) for s, (f, t) in zip(sessions, accepts)])
        assert all(s.unsettled is None for s in sessions)
    assert waits == []


@pytest.mark.gpu
@pytest.mark.parametrize("salience", [None, SALIENCE], ids=["full-context", "salience"])
def test_a_graphed_proposal_from_unsettled_entries_equals_the_eager_one_and_never_waits(salience):
    """Queued behind the verify, the proposal's graph reads the root and counts the device completed: the eager
    run's trees, and the host only launches (the second round is measured: the first records the graph)."""
    graphed, eager = graphed_and_eager(torch.bfloat16)
    pairs = [start_sessions(d, CONTEXT_LENGTHS, salience, seed=1) for d in (graphed, eager)]
    plan, budget = POLICIES["full"]
    for seed in (1, 2):
        accepts = [(f.bfloat16(), t) for f, t in _accepts(graphed, seed=seed)]
        trees, waits = [], []
        for d, sessions in zip((graphed, eager), pairs):
            d.extend_on_device(_extensions(sessions, accepts))
            requests = [ProposalRequest(s, plan, budget) for s in sessions]
            if d is graphed:
                waits = host_waits(lambda: trees.append(d.propose_pending(requests)))
            else:
                trees.append(d.propose_pending(requests))
            d.commit_accepted([Extension(s, f[: len(t)], t) for s, (f, t) in zip(sessions, accepts)])
        for got, want in zip(*trees):
            assert got.tree().tokens.tolist() == want.tree().tokens.tolist()
            assert got.tree().parents.tolist() == want.tree().parents.tolist()
    assert graphed.proposer.num_recorded >= 1 and waits == []
