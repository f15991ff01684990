"""RemoteTarget and RemoteDraft against live services: the same results as in process, session ids
scoped to their stream, every session of a stream released when it ends, silent peers bounded."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import grpc
import pytest
import torch

from diffspec.errors import InvalidRequest, PeerUnavailable
from diffspec.feature_rows import WireRows
from diffspec.sampling import SamplingParams
from diffspec.settings import DiffSpecSettings
from diffspec.tensor_wire import rows_to_tensor
from diffspec.tree import DraftTree
from diffspec.v1 import target_pb2_grpc
from draft_service.backend import DraftAccept, DraftBatch, DraftOptions, DraftStart
from draft_service.grpc_client import RemoteDraft
from target_service.backend import PrefillWork, SessionOpen, TargetBatch, VerifyStep
from target_service.grpc_client import RemoteTarget
from tests.conftest import source_prompts
from tests.gateway.servers import draft_info, free_port, target_info, wait_until

SETTINGS = DiffSpecSettings(max_message_bytes=65536, draft_timeout_seconds=60)  # a busy machine's slow reply is no late draft
GREEDY = SamplingParams()


def open_and_prefill(session_id: str, prompt: list[int], want_features: bool) -> TargetBatch:
    return TargetBatch(
        opens=[SessionOpen(session_id, prompt, GREEDY, want_features)], prefills=[PrefillWork(session_id, len(prompt))]
    )


def decode(session_id: str, root: int) -> TargetBatch:
    return TargetBatch(verifies=[VerifyStep(session_id, DraftTree.root_only(root))])


def test_remote_target_steps_equal_the_runtime_in_process(split_deployment, reference_target, tokenizer):
    # ~500 prompt rows of 3 KB: the features come back in ~25 chunks of 64 KiB
    prompt = tokenizer(source_prompts(1)[0][-2000:])["input_ids"]
    remote = RemoteTarget.connect(split_deployment.target.address, SETTINGS)
    try:
        prefilled = remote.step(open_and_prefill("a", prompt, want_features=True))
        got = prefilled.prefills["a"]
        step = remote.step(decode("a", got.first_token)).verifies["a"]
        released = remote.step(TargetBatch(releases=["a", "a"]))  # a second release is a no-op
        assert remote.info().active_sessions == 0
    finally:
        remote.close()
    want = reference_target.prefill("b", prompt, GREEDY, want_features=True)
    want_step = reference_target.decode("b")
    reference_target.release("b")
    assert not prefilled.failures and not released.failures and not released.prefills and not released.verifies
    assert (got.done_tokens, got.total_tokens, got.first_token) == (len(prompt), len(prompt), want.first_token)
    assert got.features.shape == (len(prompt), 768) and torch.equal(got.features, want.features.cpu())
    assert (step.accepted_tokens, step.accepted_nodes, step.bonus_token) == ([], [], want_step.bonus_token)
    assert torch.equal(step.features, want_step.features.cpu())


def test_a_gateway_that_relays_to_a_remote_draft_keeps_the_features_as_bytes(split_deployment, tokenizer):
    """With a remote draft the rows stay the bytes that arrived (no torch needed to pass them on); with the
    draft in process they are decoded; both are the same rows."""
    prompt = tokenizer(source_prompts(1)[0][-500:])["input_ids"]
    relay_settings = SETTINGS.model_copy(update={"draft_address": split_deployment.draft.address})
    features = {}
    for name, settings in (("relayed", relay_settings), ("decoded", SETTINGS)):
        remote = RemoteTarget.connect(split_deployment.target.address, settings)
        try:
            features[name] = remote.step(open_and_prefill("a", prompt, want_features=True)).prefills["a"].features
        finally:
            remote.close()
    relayed, decoded = features["relayed"], features["decoded"]
    assert isinstance(relayed, WireRows) and isinstance(decoded, torch.Tensor)
    assert (len(relayed), relayed.row_width) == tuple(decoded.shape) == (len(prompt), 768)
    assert torch.equal(rows_to_tensor(relayed), decoded)


def test_session_ids_live_in_their_stream_and_die_with_it(split_deployment):
    """Two gateways may both call a session "s"; one's cannot reach the other's; closing a stream frees its own."""
    first = RemoteTarget.connect(split_deployment.target.address, SETTINGS)
    second = RemoteTarget.connect(split_deployment.target.address, SETTINGS)
    try:
        a = first.step(open_and_prefill("s", [0, 5, 6, 7], want_features=False)).prefills["s"]
        b = second.step(open_and_prefill("s", [0, 5, 6, 7, 8, 9], want_features=False)).prefills["s"]
        assert (a.total_tokens, b.total_tokens) == (4, 6)  # two sessions, no "already exists"
        assert target_info(split_deployment).active_sessions == 2
        unknown = second.step(decode("t", 5))  # "t" exists nowhere, so the failure is the session's alone
        assert list(unknown.failures) == ["t"] and "unknown session" in str(unknown.failures["t"])
        first.close()
        wait_until(lambda: target_info(split_deployment).active_sessions == 1, 3, "the closed stream's session freed")
        assert second.step(decode("s", b.first_token)).verifies["s"].accepted_tokens == []
    finally:
        first.close()
        second.close()
    wait_until(lambda: target_info(split_deployment).active_sessions == 0, 3, "every session freed")
    info = target_info(split_deployment)
    assert info.num_free_pages == info.num_pages


def test_remote_draft_starts_proposes_and_accepts_over_target_features(split_deployment, reference_target):
    prompt = [0, 5, 6, 7, 8]
    prefilled = reference_target.prefill("d", prompt, GREEDY, want_features=True)
    first = prefilled.first_token
    decoded = reference_target.decode("d")
    reference_target.release("d")
    options = DraftOptions("full", "8:0.0:4")
    draft = RemoteDraft.connect(split_deployment.draft.address, SETTINGS)
    try:
        start = DraftStart("s", prompt, prefilled.features.cpu(), first, options)
        started = draft.step(DraftBatch(starts=[start], proposes=["s", "nobody"]))
        tree = started.trees["s"]
        assert int(tree.tokens[0]) == first and int(tree.parents[0]) == -1 and 1 < tree.num_nodes <= 8
        assert list(started.failures) == ["nobody"] and isinstance(started.failures["nobody"], InvalidRequest)
        accept = DraftAccept("s", [decoded.bonus_token], decoded.features.cpu())
        accepted = draft.step(DraftBatch(accepts=[accept], proposes=["s"]))
        assert not accepted.failures and int(accepted.trees["s"].tokens[0]) == decoded.bonus_token
        assert draft_info(split_deployment).active_sessions == 1
        ended = draft.step(DraftBatch(releases=["s"]))
        assert list(ended.released) == ["s"] and draft_info(split_deployment).active_sessions == 0
    finally:
        draft.close()


def test_a_malformed_draft_step_ends_the_stream_and_frees_its_sessions(split_deployment):
    draft = RemoteDraft.connect(split_deployment.draft.address, SETTINGS)
    options = DraftOptions("chain", "4:0.0:3")
    try:
        assert not draft.step(DraftBatch(starts=[DraftStart("s", [0, 5, 6], torch.zeros(3, 768), 7, options)])).failures
        assert draft_info(split_deployment).active_sessions == 1
        with pytest.raises(InvalidRequest, match="does not fit"):  # features 10 wide: the stream is INVALID_ARGUMENT
            draft.step(DraftBatch(starts=[DraftStart("t", [0, 5, 6], torch.zeros(3, 10), 7, options)]))
        wait_until(lambda: draft_info(split_deployment).active_sessions == 0, 3, "the broken stream's sessions freed")
        again = draft.step(DraftBatch(proposes=["s"]))  # a fresh stream: "s" was the old one's
        assert list(again.failures) == ["s"] and "unknown draft session" in str(again.failures["s"])
    finally:
        draft.close()


class SilentTarget(target_pb2_grpc.TargetServicer):
    """Reads every step and answers none: a hung or blackholed target."""

    def Step(self, requests: Iterator, context: grpc.ServicerContext) -> Iterator:
        for _ in requests:
            pass
        yield from ()


def test_a_silent_or_absent_target_is_peer_unavailable_within_the_step_timeout():
    server = grpc.server(ThreadPoolExecutor(2))
    target_pb2_grpc.add_TargetServicer_to_server(SilentTarget(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        remote = RemoteTarget(grpc.insecure_channel(f"127.0.0.1:{port}"), step_timeout=0.5)
        for _ in range(2):  # the second step opens a fresh stream, which times out the same way
            started = time.monotonic()
            with pytest.raises(PeerUnavailable, match="sent no reply within"):
                remote.step(decode("s", 5))
            assert time.monotonic() - started < 2
        remote.close()
    finally:
        server.stop(0)
    absent = RemoteTarget.connect(f"127.0.0.1:{free_port()}", SETTINGS)
    try:
        with pytest.raises(PeerUnavailable, match="target service unavailable"):
            absent.step(decode("s", 5))
    finally:
        absent.close()
