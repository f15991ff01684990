"""``RemoteTarget``: the ``TargetBackend`` protocol over one gRPC ``Step`` stream per gateway.

A target that cannot be reached, whose stream breaks, or that does not answer a step within
``step_timeout_seconds`` raises ``PeerUnavailable``; the stream is dropped, which releases every
session on the target, and the next step opens a fresh one.
"""

from __future__ import annotations

from diffspec.errors import PeerUnavailable
from diffspec.grpc_options import open_blocking_channel
from diffspec.settings import DiffSpecSettings
from diffspec.step_stream import StepStream, unary_call
from diffspec.v1 import target_pb2, target_pb2_grpc
from diffspec.wire import RowJoiner
from target_service.backend import TargetBatch, TargetBatchResult, TargetInfo
from target_service.messages import batch_to_proto, info_from_proto, result_from_proto

PEER = "target service"


class RemoteTarget:
    def __init__(self, channel, step_timeout: float) -> None:  # noqa: ANN001 - grpc.Channel
        self.channel = channel
        self._stub = target_pb2_grpc.TargetStub(channel)
        self._stream: StepStream[target_pb2.TargetStep, target_pb2.TargetStepResponse] = StepStream(
            self._stub.Step, PEER, step_timeout
        )

    @classmethod
    def connect(cls, address: str, settings: DiffSpecSettings) -> RemoteTarget:
        return cls(open_blocking_channel(address, settings), settings.step_timeout_seconds)

    def step(self, batch: TargetBatch) -> TargetBatchResult:
        self._stream.send([batch_to_proto(batch)])
        reply = self._next("reply")
        features = None
        if reply.feature_rows:
            joiner = RowJoiner(total_rows=reply.feature_rows, row_width=None)
            while not joiner.complete:
                joiner.add(self._next("features"))
            features = joiner.tensor()
        return result_from_proto(reply, features, PEER)

    def info(self, timeout: float | None = None) -> TargetInfo:
        return info_from_proto(unary_call(PEER, lambda: self._stub.Info(target_pb2.TargetInfoRequest(), timeout=timeout)))

    def close(self) -> None:
        self._stream.close()
        self.channel.close()

    def _next(self, kind: str):  # noqa: ANN202 - the oneof field
        response = self._stream.receive()
        if response.WhichOneof("kind") != kind:
            self._stream.close()
            raise PeerUnavailable(f"{PEER} protocol error: expected {kind}, got {response.WhichOneof('kind')}")
        return getattr(response, kind)

