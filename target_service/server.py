"""The target's gRPC servicer: one ``Session`` stream is one session over an ``InProcessTarget``.

The stream's session id is made here, never taken from the client, so a stream can only
touch its own KV pages; and whichever way the stream ends (release, half-close, cancel,
disconnect, deadline, error) the ``finally`` releases the session, so every page returns.
"""

from __future__ import annotations

from typing import Any

import grpc

from diffspec.metrics import ServingMetrics
from diffspec.serving import Loading, SessionStep, serve_session
from diffspec.settings import DiffSpecSettings
from diffspec.v1 import target_pb2, target_pb2_grpc
from diffspec.wire import split_rows, tree_from_proto
from target_service.inprocess import InProcessTarget
from target_service.messages import info_to_proto, sampling_from_proto, step_to_proto

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["Target"].full_name
Context = grpc.aio.ServicerContext


class TargetServicer(target_pb2_grpc.TargetServicer):
    def __init__(self, target: Loading[InProcessTarget], settings: DiffSpecSettings, metrics: ServingMetrics) -> None:
        self.target = target
        self.max_message_bytes = settings.max_message_bytes
        self.metrics = metrics
        self._steps: dict[str, SessionStep] = {
            "prefill": self._prefill,
            "verify": self._verify,
            "decode": self._decode,
            "release": self._release,
        }

    async def Session(self, requests: Any, context: Context) -> None:
        target = self.target.get()
        await serve_session(context, target, self._steps, target.release, "target")

    async def Info(self, request: target_pb2.TargetInfoRequest, context: Context) -> target_pb2.TargetInfoResponse:
        target = self.target.get()
        return info_to_proto(await target.info(), target.batcher.queue_depth)

    async def _prefill(
        self, target: InProcessTarget, session_id: str, message: target_pb2.PrefillRequest, context: Context
    ) -> None:
        sampling = sampling_from_proto(message.sampling)
        with self.metrics.time_call("prefill"):
            result = await target.prefill(session_id, list(message.prompt_ids), sampling, message.want_features)
        rows = 0 if result.features is None else result.features.shape[0]
        reply = target_pb2.PrefillReply(
            first_token=result.first_token, num_cached_tokens=result.num_cached_tokens, feature_rows=rows
        )
        await context.write(target_pb2.TargetResponse(prefill=reply))
        if result.features is not None:
            for chunk in split_rows(result.features, self.max_message_bytes):
                await context.write(target_pb2.TargetResponse(features=chunk))

    async def _verify(
        self, target: InProcessTarget, session_id: str, message: target_pb2.VerifyRequest, context: Context
    ) -> None:
        tree = tree_from_proto(message.tree)
        with self.metrics.time_call("verify"):
            result = await target.verify(session_id, tree)
        await context.write(target_pb2.TargetResponse(step=step_to_proto(result)))

    async def _decode(
        self, target: InProcessTarget, session_id: str, message: target_pb2.DecodeRequest, context: Context
    ) -> None:
        with self.metrics.time_call("decode"):
            result = await target.decode(session_id)
        await context.write(target_pb2.TargetResponse(step=step_to_proto(result)))

    async def _release(
        self, target: InProcessTarget, session_id: str, message: target_pb2.TargetReleaseRequest, context: Context
    ) -> None:
        await target.release(session_id)
        await context.write(target_pb2.TargetResponse(release=target_pb2.TargetReleaseReply()))
