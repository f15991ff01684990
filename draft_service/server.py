"""The draft's gRPC servicer: one ``Step`` stream per gateway over the ``DraftRuntime``.

As on the target, a stream's session ids live in a scope of its own and the ``finally``
releases every draft session still open on it (draft KV, arena slots, the prefix-cache pins of
prompts looked up and never started) however the stream ends, once the step in flight has ended
(``StepWorker``: a start still running would leak otherwise). A step's features follow it in row
chunks, each checked against the head's width and against the rows the step's starts and accepts need.
"""

from __future__ import annotations

import uuid
from typing import Any

import grpc
import torch

from diffspec.errors import InvalidRequest
from diffspec.feature_rows import RowJoiner
from diffspec.metrics import ServingMetrics
from diffspec.serving import Loading, StepWorker, model_name
from diffspec.settings import DiffSpecSettings
from diffspec.tensor_wire import rows_to_tensor
from diffspec.v1 import draft_pb2, draft_pb2_grpc
from draft_service.backend import DraftBatch
from draft_service.messages import batch_from_proto, feature_rows, result_to_proto
from draft_service.runtime import DraftRuntime

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["Draft"].full_name
Context = grpc.aio.ServicerContext


class DraftServicer(draft_pb2_grpc.DraftServicer):
    def __init__(self, draft: Loading[DraftRuntime], settings: DiffSpecSettings, metrics: ServingMetrics) -> None:
        self.draft = draft
        self.model = model_name(settings.draft_model)
        self.metrics = metrics

    async def Step(self, requests: Any, context: Context) -> None:
        runtime = self.draft.get()
        scope = uuid.uuid4().hex + "/"
        open_sessions: set[str] = set()
        worker = StepWorker()
        try:
            while (message := await context.read()) is not grpc.aio.EOF:
                if message.WhichOneof("kind") != "step":
                    raise InvalidRequest("feature chunks must follow a step that announces them")
                batch = batch_from_proto(message.step, await self._features(context, message.step, runtime), scope)
                open_sessions.update(s.session_id for s in [*batch.lookups, *batch.starts])
                with self.metrics.time_call("step"):
                    result = await worker.run(runtime.step, batch)
                open_sessions.difference_update(batch.releases, result.failures)
                await context.write(result_to_proto(result, scope))
        finally:
            await worker.finally_run(runtime.step, DraftBatch(releases=sorted(open_sessions)))

    async def Info(self, request: draft_pb2.DraftInfoRequest, context: Context) -> draft_pb2.DraftInfoResponse:
        runtime = self.draft.get()
        c, weight = runtime.head.config, runtime.head.fc.weight
        return draft_pb2.DraftInfoResponse(
            model=self.model,
            vocab_size=c.vocab_size,
            draft_vocab_size=c.draft_vocab_size,
            target_hidden_size=c.target_hidden_size,
            feature_layers=c.feature_layers,
            max_positions=c.max_positions,
            active_sessions=len(runtime.sessions),
            device=str(weight.device),
            dtype=str(weight.dtype).removeprefix("torch."),
        )

    @staticmethod
    async def _features(context: Context, step: draft_pb2.DraftStep, runtime: DraftRuntime) -> torch.Tensor:
        """The step's feature rows, read chunk by chunk (an empty [0, 0] when it has none)."""
        rows = feature_rows(step)
        if rows != step.feature_rows:
            raise InvalidRequest(f"a step with {rows} feature rows announced {step.feature_rows}")
        if rows == 0:
            return torch.empty(0, 0)
        joiner = RowJoiner(total_rows=rows, row_width=3 * runtime.head.config.target_hidden_size)
        while not joiner.complete:
            chunk = await context.read()
            if chunk is grpc.aio.EOF or chunk.WhichOneof("kind") != "features":
                raise InvalidRequest(f"features incomplete: {joiner.rows_done} of {joiner.total_rows} rows arrived")
            joiner.add(chunk.features)
        return rows_to_tensor(joiner.rows())
