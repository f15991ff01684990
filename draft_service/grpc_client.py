"""``RemoteDraft``: the ``DraftBackend`` protocol over one gRPC ``Step`` stream per gateway.

A proposal that does not come within ``proposal_timeout`` (a few verify steps' worth) leaves that
step without trees, so its requests verify Auto trees at once and lose nothing: a draft session
only extends its context by the tokens the target emitted, whatever tree they came from. The
late reply stays owed; until it comes, steps still send the draft their releases, starts and
accepts, in order, but no proposal, so a draft that resumes catches up cheaply and is asked to
propose again at the next step after. Trees in late replies are dropped; their failures are not.

A draft that cannot be reached, whose stream breaks, that sends nothing for ``step_timeout`` while
replies are owed, or that falls ``MAX_STEPS_BEHIND`` steps behind raises ``PeerUnavailable``: the engine turns its requests to Auto for good. The stream is dropped,
which releases every draft session on it; later requests open a fresh one, so a restarted draft
is picked up again. ``wire`` counts the bytes of each step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from functools import partial

from diffspec.errors import DiffSpecError, PeerUnavailable
from diffspec.grpc_options import Metadata, call_metadata, open_blocking_channel
from diffspec.metrics import WireTraffic
from diffspec.settings import DiffSpecSettings
from diffspec.step_stream import StepStream, unary_call
from diffspec.v1 import draft_pb2, draft_pb2_grpc
from draft_service.backend import DraftBatch, DraftBatchResult
from draft_service.messages import batch_to_proto, result_from_proto

log = logging.getLogger(__name__)

PEER = "draft service"
MAX_STEPS_BEHIND = 512  # owed replies before a draft that answers, but too slowly to catch up, is dropped


class RemoteDraft:
    def __init__(
        self,
        channel,  # noqa: ANN001 - grpc.Channel
        step_timeout: float,
        max_message_bytes: int,
        metadata: Metadata = (),
        proposal_timeout: float | None = None,
    ) -> None:
        """``metadata``: sent with the step stream (the bearer token); ``proposal_timeout``: seconds a step
        waits for its trees (None = ``step_timeout``); ``step_timeout``: seconds the draft may stay silent."""
        self.channel = channel
        self.max_message_bytes = max_message_bytes
        self.step_timeout = step_timeout
        self.proposal_timeout = step_timeout if proposal_timeout is None else proposal_timeout
        self.wire = WireTraffic()  # prefill = a step that starts sessions (their prompts' features go with it)
        self.late_steps = 0  # steps whose proposals did not come in time (they ran Auto)
        self._owed = 0  # replies of steps sent and not yet read
        self._silent_since = 0.0  # time.monotonic() since which owed replies have not come (the late step's send,
        # then each reply read)
        stub = draft_pb2_grpc.DraftStub(channel)
        self._info = partial(stub.Info, draft_pb2.DraftInfoRequest(), metadata=metadata)
        self._stream: StepStream[draft_pb2.DraftStepRequest, draft_pb2.DraftStepReply] = StepStream(
            partial(stub.Step, metadata=metadata), PEER, step_timeout
        )

    @classmethod
    def connect(cls, address: str, settings: DiffSpecSettings) -> RemoteDraft:
        return cls(
            open_blocking_channel(address, settings),
            settings.step_timeout_seconds,
            settings.max_message_bytes,
            call_metadata(settings),
            settings.draft_timeout_seconds,
        )

    def step(self, batch: DraftBatch) -> DraftBatchResult:
        try:
            late_failures = self._catch_up()
            if self._owed:  # still behind: send what keeps the sessions in step, ask for no trees
                self._send(replace(batch, proposes=[]))
                return DraftBatchResult(failures=late_failures)
            sent = self._send(batch)
            reply = self._stream.poll(self.proposal_timeout)
        except DiffSpecError:
            self._owed = 0  # the stream is gone, and with it every reply it owed
            raise
        if reply is None:
            self._fall_behind()
            return DraftBatchResult(failures=late_failures)
        self._heard()
        self.wire.count(bool(batch.starts), sent, reply.ByteSize())
        result = result_from_proto(reply, PEER)
        result.failures.update(late_failures)
        return result

    def feature_layers(self, timeout: float) -> tuple[int, ...]:
        """The target layers the served head reads (its aux layer ids; () = the target's default)."""
        return tuple(unary_call(PEER, lambda: self._info(timeout=timeout)).feature_layers)

    def close(self) -> None:
        self._owed = 0
        self._stream.close()
        self.channel.close()

    def _send(self, batch: DraftBatch) -> int:
        """Send one step (nothing when it carries no work); its bytes."""
        if not batch:
            return 0
        step, features = batch_to_proto(batch)
        messages = [draft_pb2.DraftStepRequest(step=step)]
        if features is not None:
            messages += [draft_pb2.DraftStepRequest(features=c) for c in features.chunks(self.max_message_bytes)]
        self._stream.send(messages)
        self._owed += 1
        sent = sum(m.ByteSize() for m in messages)
        if not batch.proposes:
            self.wire.count(bool(batch.starts), sent, 0)
        return sent

    def _heard(self) -> None:
        self._owed -= 1
        self._silent_since = time.monotonic()

    def _fall_behind(self) -> None:
        self._silent_since = time.monotonic() - self.proposal_timeout  # when the late step went out
        self.late_steps += 1
        log.warning("the draft's proposals did not come within %.2f s: this step runs Auto", self.proposal_timeout)

    def _catch_up(self) -> dict[str, DiffSpecError]:
        """Read the replies that have come in since a step gave up on them; the failures they carry.
        Raises PeerUnavailable (dropping the stream) once the draft owing replies has sent none for
        ``step_timeout``, or owes more than ``MAX_STEPS_BEHIND``."""
        failures: dict[str, DiffSpecError] = {}
        while self._owed:
            reply = self._stream.poll(0)
            if reply is None:
                silent_s = time.monotonic() - self._silent_since
                if silent_s > self.step_timeout or self._owed > MAX_STEPS_BEHIND:
                    self._stream.close()
                    raise PeerUnavailable(f"{PEER} is {self._owed} steps behind, silent for {silent_s:.1f} s")
                break
            self._heard()
            failures.update(result_from_proto(reply, PEER).failures)
        return failures
