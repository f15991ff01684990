"""``RemoteTarget``: the ``TargetBackend`` protocol over one gRPC ``Step`` stream per gateway.

A target that cannot be reached, whose stream breaks, or that does not answer a step within
``step_timeout_seconds`` raises ``PeerUnavailable``; the stream is dropped, which releases every
session on the target, and the next step opens a fresh one. ``wire`` counts the bytes of each
completed step.
"""

from __future__ import annotations

from functools import partial

from diffspec.errors import PeerUnavailable
from diffspec.grpc_options import Metadata, call_metadata, open_blocking_channel
from diffspec.metrics import WireTraffic
from diffspec.settings import DiffSpecSettings
from diffspec.step_stream import StepStream, unary_call
from diffspec.v1 import target_pb2, target_pb2_grpc
from diffspec.wire import RowJoiner
from target_service.backend import TargetBatch, TargetBatchResult, TargetInfo
from target_service.messages import batch_to_proto, info_from_proto, result_from_proto

PEER = "target service"


class RemoteTarget:
    def __init__(self, channel, step_timeout: float, metadata: Metadata = ()) -> None:  # noqa: ANN001 - grpc.Channel
        """``metadata``: sent with every call (the bearer token)."""
        self.channel = channel
        self.metadata = metadata
        self._stub = target_pb2_grpc.TargetStub(channel)
        self.wire = WireTraffic()  # prefill = a step that carries prompt chunks
        self._bytes_received = 0  # of the step in flight
        self._stream: StepStream[target_pb2.TargetStep, target_pb2.TargetStepResponse] = StepStream(
            partial(self._stub.Step, metadata=metadata), PEER, step_timeout
        )

    @classmethod
    def connect(cls, address: str, settings: DiffSpecSettings) -> RemoteTarget:
        return cls(open_blocking_channel(address, settings), settings.step_timeout_seconds, call_metadata(settings))

    def step(self, batch: TargetBatch) -> TargetBatchResult:
        request = batch_to_proto(batch)
        self._bytes_received = 0
        self._stream.send([request])
        reply = self._next("reply")
        features = None
        if reply.feature_rows:
            joiner = RowJoiner(total_rows=reply.feature_rows, row_width=None)
            while not joiner.complete:
                joiner.add(self._next("features"))
            features = joiner.tensor()
        self.wire.count(bool(batch.prefills), request.ByteSize(), self._bytes_received)
        return result_from_proto(reply, features, PEER)

    def info(self, timeout: float | None = None) -> TargetInfo:
        request = target_pb2.TargetInfoRequest()
        return info_from_proto(
            unary_call(PEER, lambda: self._stub.Info(request, timeout=timeout, metadata=self.metadata))
        )

    def close(self) -> None:
        self._stream.close()
        self.channel.close()

    def _next(self, kind: str):  # noqa: ANN202 - the oneof field
        response = self._stream.receive()
        self._bytes_received += response.ByteSize()
        if response.WhichOneof("kind") != kind:
            self._stream.close()
            raise PeerUnavailable(f"{PEER} protocol error: expected {kind}, got {response.WhichOneof('kind')}")
        return getattr(response, kind)

