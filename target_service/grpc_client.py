"""``RemoteTarget``: the ``TargetBackend`` protocol over one gRPC ``Step`` stream per gateway.

A target that cannot be reached, whose stream breaks, or that does not answer a step within
``step_timeout_seconds`` raises ``PeerUnavailable``; the stream is dropped, which releases every
session on the target, and the next step opens a fresh one. ``wire`` counts the bytes of each
completed step. Features stay the bytes that arrived (``WireRows``) for a gateway that relays them
to a remote draft, so it needs no torch; a draft in this process gets them decoded into tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from diffspec.errors import PeerUnavailable
from diffspec.feature_rows import Features, RowJoiner, WireRows
from diffspec.grpc_options import Metadata, call_metadata, open_blocking_channel
from diffspec.metrics import WireTraffic
from diffspec.settings import DiffSpecSettings
from diffspec.step_stream import StepStream, unary_call
from diffspec.v1 import target_pb2, target_pb2_grpc
from target_service.backend import TargetBatch, TargetBatchResult, TargetInfo
from target_service.messages import batch_to_proto, info_from_proto, result_from_proto

PEER = "target service"


class RemoteTarget:
    def __init__(
        self, channel, step_timeout: float, metadata: Metadata = (), decode_features: bool = False  # noqa: ANN001
    ) -> None:
        """``channel``: a grpc.Channel; ``metadata``: sent with every call (the bearer token);
        ``decode_features``: hand features on as tensors (for a draft in this process)."""
        self.channel = channel
        self._decode: Callable[[WireRows], Features] | None = None
        if decode_features:
            from diffspec.tensor_wire import rows_to_tensor  # only a process that runs a draft loads torch

            self._decode = rows_to_tensor
        self.metadata = metadata
        self._stub = target_pb2_grpc.TargetStub(channel)
        self.wire = WireTraffic()  # prefill = a step that carries prompt chunks
        self._bytes_received = 0  # of the step in flight
        self._stream: StepStream[target_pb2.TargetStep, target_pb2.TargetStepResponse] = StepStream(
            partial(self._stub.Step, metadata=metadata), PEER, step_timeout
        )

    @classmethod
    def connect(cls, address: str, settings: DiffSpecSettings) -> RemoteTarget:
        """A client for ``address``; features are decoded when no remote draft is set (the draft runs here)."""
        channel = open_blocking_channel(address, settings)
        decode = not settings.draft_address
        return cls(channel, settings.step_timeout_seconds, call_metadata(settings), decode_features=decode)

    def step(self, batch: TargetBatch) -> TargetBatchResult:
        request = batch_to_proto(batch)
        self._bytes_received = 0
        self._stream.send([request])
        reply = self._next("reply")
        features: Features | None = None
        if reply.feature_rows:
            joiner = RowJoiner(total_rows=reply.feature_rows, row_width=None)
            while not joiner.complete:
                joiner.add(self._next("features"))
            features = joiner.rows() if self._decode is None else self._decode(joiner.rows())
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

