"""``RemoteDraft``: the ``DraftBackend`` protocol over one gRPC ``Step`` stream per gateway.

A draft that cannot be reached, whose stream breaks, or that does not answer within
``step_timeout_seconds`` raises ``PeerUnavailable``: the engine turns its requests to Auto. The
stream is dropped, which releases every draft session on it; later requests open a fresh one,
so a restarted draft is picked up again. ``wire`` counts the bytes of each completed step.
"""

from __future__ import annotations

from functools import partial

from diffspec.grpc_options import Metadata, call_metadata, open_blocking_channel
from diffspec.metrics import WireTraffic
from diffspec.settings import DiffSpecSettings
from diffspec.step_stream import StepStream, unary_call
from diffspec.v1 import draft_pb2, draft_pb2_grpc
from draft_service.backend import DraftBatch, DraftBatchResult
from draft_service.messages import batch_to_proto, result_from_proto

PEER = "draft service"


class RemoteDraft:
    def __init__(
        self, channel, step_timeout: float, max_message_bytes: int, metadata: Metadata = ()  # noqa: ANN001 - grpc.Channel
    ) -> None:
        """``metadata``: sent with the step stream (the bearer token)."""
        self.channel = channel
        self.max_message_bytes = max_message_bytes
        self.wire = WireTraffic()  # prefill = a step that starts sessions (their prompts' features go with it)
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
        )

    def step(self, batch: DraftBatch) -> DraftBatchResult:
        step, features = batch_to_proto(batch)
        messages = [draft_pb2.DraftStepRequest(step=step)]
        if features is not None:
            messages += [draft_pb2.DraftStepRequest(features=c) for c in features.chunks(self.max_message_bytes)]
        self._stream.send(messages)
        reply = self._stream.receive()
        self.wire.count(bool(batch.starts), sum(m.ByteSize() for m in messages), reply.ByteSize())
        return result_from_proto(reply, PEER)

    def feature_layers(self, timeout: float) -> tuple[int, ...]:
        """The target layers the served head reads (its aux layer ids; () = the target's default)."""
        return tuple(unary_call(PEER, lambda: self._info(timeout=timeout)).feature_layers)

    def close(self) -> None:
        self._stream.close()
        self.channel.close()
