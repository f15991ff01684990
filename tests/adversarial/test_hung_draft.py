"""A draft that stops answering costs a step its trees, never the stream: ``RemoteDraft`` against a draft
service that can be held mid-step, then a SIGSTOPped draft process in the split deployment."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import grpc
import pytest

from diffspec.errors import PeerUnavailable
from diffspec.tree_nodes import TreeNodes
from diffspec.v1 import draft_pb2, draft_pb2_grpc, gateway_pb2, gateway_pb2_grpc, tensor_pb2
from draft_service.backend import DraftBatch
from draft_service.grpc_client import RemoteDraft
from tests.adversarial.conftest import DRAFT_TIMEOUT_S, STEP_TIMEOUT_S
from tests.gateway.conftest import CODE_PROMPTS, generate
from tests.gateway.servers import wait_all_released

PROPOSAL_TIMEOUT_S = 0.3


class HeldDraft(draft_pb2_grpc.DraftServicer):
    """Answers each step with a root-only tree per proposed session, once ``running`` is set; records the steps.
    A released session named ``fail-*`` fails there."""

    def __init__(self) -> None:
        self.running = threading.Event()
        self.running.set()
        self.steps: list[draft_pb2.DraftStep] = []

    def Step(self, requests: Iterator, context: grpc.ServicerContext) -> Iterator[draft_pb2.DraftStepReply]:
        for message in requests:
            self.running.wait()
            self.steps.append(message.step)
            trees = [draft_pb2.ProposedTree(session_id=s, tree=TreeNodes.root_only(7).to_proto()) for s in message.step.proposes]
            failures = [
                tensor_pb2.SessionFailure(session_id=session_id, code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message="bad")
                for session_id in message.step.releases
                if session_id.startswith("fail-")
            ]
            yield draft_pb2.DraftStepReply(trees=trees, failures=failures)


@pytest.fixture
def held_draft() -> Iterator[tuple[HeldDraft, RemoteDraft]]:
    servicer = HeldDraft()
    server = grpc.server(ThreadPoolExecutor(2))
    draft_pb2_grpc.add_DraftServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    remote = RemoteDraft(grpc.insecure_channel(f"127.0.0.1:{port}"), 3.0, 1 << 20, proposal_timeout=PROPOSAL_TIMEOUT_S)
    yield servicer, remote
    servicer.running.set()
    remote.close()
    server.stop(0)


def test_a_late_proposal_runs_its_step_without_trees_and_the_draft_is_asked_again(held_draft):
    draft, remote = held_draft
    assert list(remote.step(DraftBatch(proposes=["a"])).trees) == ["a"]
    draft.running.clear()
    started = time.monotonic()
    late = remote.step(DraftBatch(proposes=["a"]))
    assert late.trees == {} and not late.failures
    assert time.monotonic() - started < PROPOSAL_TIMEOUT_S + 0.5
    behind = remote.step(DraftBatch(releases=["fail-b"], proposes=["a"]))  # still owed: sent at once, no proposal
    assert behind.trees == {} and time.monotonic() - started < PROPOSAL_TIMEOUT_S + 0.5
    draft.running.set()
    time.sleep(0.2)  # the draft works through what it was sent
    caught_up = remote.step(DraftBatch(proposes=["a"]))
    assert list(caught_up.trees) == ["a"] and list(caught_up.failures) == ["fail-b"]  # a late reply's failure
    assert [(list(s.releases), list(s.proposes)) for s in draft.steps] == [
        ([], ["a"]), ([], ["a"]), (["fail-b"], []), ([], ["a"]),
    ]  # fmt: skip
    assert remote.late_steps == 1


def test_a_draft_behind_for_the_step_timeout_is_dropped(held_draft):
    draft, remote = held_draft
    remote.step_timeout = 0.6
    draft.running.clear()
    assert remote.step(DraftBatch(proposes=["a"])).trees == {}
    time.sleep(0.7)
    with pytest.raises(PeerUnavailable, match="silent for"):
        remote.step(DraftBatch(proposes=["a"]))
    draft.running.set()
    assert list(remote.step(DraftBatch(proposes=["a"])).trees) == ["a"]  # a fresh stream


MAX_NEW = 400
STOPPED_CHUNKS = 11  # chunks the stream delivers while the draft is stopped
MIN_STOP_S = 2 * DRAFT_TIMEOUT_S  # long enough that a step surely waited for the stopped draft's trees
# The draft stays stopped until both, or at most this long: well inside the step timeout, past which the
# gateway drops a draft that owes replies (the stream would finish with Auto, and the test see no resume).
MAX_STOP_S = STEP_TIMEOUT_S - 1.5


@pytest.mark.slow
def test_a_sigstopped_draft_turns_steps_to_auto_at_once_and_is_used_again_after(bounded_deployment, auto_reference):
    """One step waits DRAFT_TIMEOUT_S for the stopped draft's trees; the steps after it go on at once, so
    STOPPED_CHUNKS chunks come well inside the step timeout even on a busy machine (a few hundred ms a step
    would do), and the draft is resumed as soon as they have (and MIN_STOP_S has passed)."""
    deployment = bounded_deployment.trio
    try:
        with deployment.gateway.channel() as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            generate(stub, text=CODE_PROMPTS[1], max_new_tokens=16, policy="full")  # the draft's first steps are slow
            request = gateway_pb2.GenerateRequest(text=CODE_PROMPTS[0], max_new_tokens=MAX_NEW, policy="full")
            ids: list[int] = []
            chunk_sizes: list[tuple[str, int]] = []  # (draft state, tokens) per chunk
            state, stopped_at = "running", 0.0
            stats = None
            for response in stub.Generate(request, timeout=120):
                ids += response.token_ids
                if response.token_ids:
                    chunk_sizes.append((state, len(response.token_ids)))
                if state == "running" and len(ids) >= 20:
                    deployment.draft.process.send_signal(signal.SIGSTOP)
                    state, stopped_at = "stopped", time.monotonic()
                elif state == "stopped" and (
                    (sum(s == "stopped" for s, _ in chunk_sizes) >= STOPPED_CHUNKS
                     and time.monotonic() - stopped_at > MIN_STOP_S)
                    or time.monotonic() - stopped_at > MAX_STOP_S
                ):  # fmt: skip
                    deployment.draft.process.send_signal(signal.SIGCONT)
                    state = "resumed"
                if response.HasField("stats"):
                    stats = response.stats
        assert ids == auto_reference(CODE_PROMPTS[0], MAX_NEW)
        assert state == "resumed", "the stream ended before the draft was resumed"
        stopped = [n for s, n in chunk_sizes if s == "stopped"]
        assert len(stopped) >= STOPPED_CHUNKS  # tokens kept coming while the draft was stopped
        resumed = [n for s, n in chunk_sizes if s == "resumed"]
        assert max(resumed) > 1, "no step after the resume accepted a draft token"
        assert stats is not None and not stats.fell_back_to_auto
        wait_all_released(deployment, timeout=10)
    finally:
        deployment.draft.process.send_signal(signal.SIGCONT)
