"""The draft's gRPC servicer: one ``Session`` stream is one session over an ``InProcessDraft``.

As on the target, the session id is made here and the ``finally`` releases the session
(draft KV, arena slots) however the stream ends. A start request is followed by its
features in row chunks, each checked against the prompt length and the head's width.
"""

from __future__ import annotations

from typing import Any

import grpc

from diffspec.errors import InvalidRequest
from diffspec.metrics import ServingMetrics
from diffspec.serving import Loading, SessionStep, serve_session
from diffspec.settings import DiffSpecSettings
from diffspec.v1 import draft_pb2, draft_pb2_grpc
from diffspec.wire import RowJoiner, tensor_from_proto, tree_to_proto
from draft_service.inprocess import InProcessDraft
from draft_service.messages import options_from_proto, stats_to_proto

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["Draft"].full_name
Context = grpc.aio.ServicerContext


class DraftServicer(draft_pb2_grpc.DraftServicer):
    def __init__(self, draft: Loading[InProcessDraft], settings: DiffSpecSettings, metrics: ServingMetrics) -> None:
        self.draft = draft
        self.model = str(settings.draft_model)
        self.metrics = metrics
        self._steps: dict[str, SessionStep] = {
            "start": self._start,
            "propose": self._propose,
            "accept": self._accept,
            "stats": self._stats,
            "release": self._release,
        }

    async def Session(self, requests: Any, context: Context) -> None:
        draft = self.draft.get()
        await serve_session(context, draft, self._steps, draft.release, "draft")

    async def Info(self, request: draft_pb2.DraftInfoRequest, context: Context) -> draft_pb2.DraftInfoResponse:
        runtime = self.draft.get().runtime
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

    async def _start(
        self, draft: InProcessDraft, session_id: str, message: draft_pb2.StartRequest, context: Context
    ) -> None:
        c = draft.runtime.head.config
        prompt_ids = list(message.prompt_ids)
        _check_token_ids([*prompt_ids, message.first_token], c.vocab_size)
        if not prompt_ids or message.feature_rows != len(prompt_ids):
            raise InvalidRequest(
                f"a prompt of {len(prompt_ids)} tokens with {message.feature_rows} feature rows; "
                "expected one row per token"
            )
        joiner = RowJoiner(total_rows=len(prompt_ids), row_width=3 * c.target_hidden_size)
        while not joiner.complete:
            chunk = await context.read()
            if chunk is grpc.aio.EOF or chunk.WhichOneof("kind") != "features":
                raise InvalidRequest(f"features incomplete: {joiner.rows_done} of {joiner.total_rows} rows arrived")
            joiner.add(chunk.features)
        with self.metrics.time_call("start"):
            await draft.start(
                session_id, prompt_ids, joiner.tensor(), message.first_token, options_from_proto(message.options)
            )
        await context.write(draft_pb2.DraftResponse(start=draft_pb2.StartReply()))

    async def _propose(
        self, draft: InProcessDraft, session_id: str, message: draft_pb2.ProposeRequest, context: Context
    ) -> None:
        with self.metrics.time_call("propose"):
            tree = await draft.propose(session_id)
        await context.write(draft_pb2.DraftResponse(propose=draft_pb2.ProposeReply(tree=tree_to_proto(tree))))

    async def _accept(
        self, draft: InProcessDraft, session_id: str, message: draft_pb2.AcceptRequest, context: Context
    ) -> None:
        c = draft.runtime.head.config
        emitted = list(message.emitted_tokens)
        _check_token_ids(emitted, c.vocab_size)
        features = tensor_from_proto(message.features)
        if tuple(features.shape) != (len(emitted), 3 * c.target_hidden_size):
            raise InvalidRequest(
                f"accept features of shape {tuple(features.shape)}; "
                f"expected ({len(emitted)}, {3 * c.target_hidden_size})"
            )
        with self.metrics.time_call("accept"):
            await draft.accept(session_id, emitted, features)
        await context.write(draft_pb2.DraftResponse(accept=draft_pb2.AcceptReply()))

    async def _stats(
        self, draft: InProcessDraft, session_id: str, message: draft_pb2.StatsRequest, context: Context
    ) -> None:
        stats = await draft.stats(session_id)
        await context.write(draft_pb2.DraftResponse(stats=stats_to_proto(stats)))

    async def _release(
        self, draft: InProcessDraft, session_id: str, message: draft_pb2.DraftReleaseRequest, context: Context
    ) -> None:
        await draft.release(session_id)
        await context.write(draft_pb2.DraftResponse(release=draft_pb2.DraftReleaseReply()))


def _check_token_ids(ids: list[int], vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"token ids out of the vocabulary [0, {vocab_size}): {bad[:5]}")
