"""The target's gRPC servicer: one ``Step`` stream per gateway over the ``TargetRuntime``.

A stream's session ids are put in a scope of its own, so a stream can only touch the KV pages
of sessions it opened; whichever way the stream ends (half-close, cancel, disconnect, error),
the ``finally`` releases every session still open on it, once the step in flight has ended (``StepWorker``),
so every page returns.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

import grpc

from diffspec.metrics import ServingMetrics
from diffspec.serving import Loading, StepWorker, model_name
from diffspec.settings import DiffSpecSettings
from diffspec.v1 import target_pb2, target_pb2_grpc
from diffspec.feature_rows import wire_rows
from target_service.backend import TargetBatchResult
from target_service.messages import batch_from_proto, info_to_proto, result_to_proto
from target_service.runtime import TargetRuntime

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["Target"].full_name
Context = grpc.aio.ServicerContext


class TargetServicer(target_pb2_grpc.TargetServicer):
    def __init__(self, target: Loading[TargetRuntime], settings: DiffSpecSettings, metrics: ServingMetrics) -> None:
        self.target = target
        self.max_message_bytes = settings.max_message_bytes
        self.metrics = metrics

    async def Step(self, requests: Any, context: Context) -> None:
        runtime = self.target.get()
        scope = uuid.uuid4().hex + "/"
        open_sessions: set[str] = set()
        worker = StepWorker()
        try:
            while (message := await context.read()) is not grpc.aio.EOF:
                batch, malformed = batch_from_proto(message, scope)
                open_sessions.update(o.session_id for o in batch.opens)
                with self.metrics.time_call("step"):
                    result = await worker.run(runtime.step, batch)
                open_sessions.difference_update(batch.releases, result.failures)
                result.failures.update({scope + sid: failure for sid, failure in malformed.items()})
                await self._reply(context, result, scope)
        finally:
            await worker.finally_run(_release_all, runtime, open_sessions)

    async def Info(self, request: target_pb2.TargetInfoRequest, context: Context) -> target_pb2.TargetInfoResponse:
        info = self.target.get().info()
        return info_to_proto(replace(info, model=model_name(info.model)))

    async def _reply(self, context: Context, result: TargetBatchResult, scope: str) -> None:
        reply, features = result_to_proto(result, scope)
        await context.write(target_pb2.TargetStepResponse(reply=reply))
        if features is not None:
            for chunk in wire_rows(features).chunks(self.max_message_bytes):
                await context.write(target_pb2.TargetStepResponse(features=chunk))


def _release_all(runtime: TargetRuntime, session_ids: set[str]) -> None:
    for session_id in session_ids:
        runtime.release(session_id)
