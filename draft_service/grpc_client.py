"""``RemoteDraft``: the ``DraftBackend`` protocol over gRPC, one ``Session`` stream per session id.

Every failure to reach the draft or keep its stream raises ``PeerUnavailable``, which the
engine answers by finishing the request with Auto. The prompt's features go out in row
chunks under the message size limit, one chunk in memory at a time.
"""

from __future__ import annotations

import grpc
import torch

from diffspec.grpc_options import open_channel
from diffspec.rpc_client import RemoteSessions
from diffspec.settings import DiffSpecSettings
from diffspec.tree import DraftTree
from diffspec.v1 import draft_pb2, draft_pb2_grpc
from diffspec.wire import split_rows, tensor_to_proto, tree_from_proto
from draft_service.backend import DraftOptions, DraftStats
from draft_service.messages import options_to_proto, stats_from_proto

PEER = "draft service"
_RELEASE = draft_pb2.DraftRequest(release=draft_pb2.DraftReleaseRequest())


class RemoteDraft:
    def __init__(self, channel: grpc.aio.Channel, max_message_bytes: int, timeout: float | None = None) -> None:
        self.channel = channel
        self.max_message_bytes = max_message_bytes
        self.timeout = timeout  # seconds each session may take, from its start (None = no deadline)
        stub = draft_pb2_grpc.DraftStub(channel)
        self._sessions: RemoteSessions[draft_pb2.DraftRequest] = RemoteSessions(
            PEER, lambda: stub.Session(timeout=timeout), _RELEASE
        )

    @classmethod
    def connect(cls, address: str, settings: DiffSpecSettings) -> RemoteDraft:
        return cls(open_channel(address, settings), settings.max_message_bytes)

    def with_timeout(self, timeout: float | None) -> RemoteDraft:
        """A client on the same channel whose sessions end by ``timeout`` seconds from now: one per request."""
        return RemoteDraft(self.channel, self.max_message_bytes, timeout)

    async def start(
        self, session_id: str, prompt_ids: list[int], features: torch.Tensor, first_token: int, options: DraftOptions
    ) -> None:
        stream = self._sessions.open(session_id)
        header = draft_pb2.StartRequest(
            prompt_ids=prompt_ids,
            first_token=first_token,
            options=options_to_proto(options),
            feature_rows=features.shape[0],
        )
        chunks = (draft_pb2.DraftRequest(features=c) for c in split_rows(features, self.max_message_bytes))
        await stream.send([draft_pb2.DraftRequest(start=header)])
        await stream.send(chunks)
        await stream.receive("start")

    async def propose(self, session_id: str) -> DraftTree:
        request = draft_pb2.DraftRequest(propose=draft_pb2.ProposeRequest())
        return tree_from_proto((await self._sessions.get(session_id).exchange(request, "propose")).tree)

    async def accept(self, session_id: str, emitted_tokens: list[int], features: torch.Tensor) -> None:
        accept = draft_pb2.AcceptRequest(emitted_tokens=emitted_tokens, features=tensor_to_proto(features))
        await self._sessions.get(session_id).exchange(draft_pb2.DraftRequest(accept=accept), "accept")

    async def stats(self, session_id: str) -> DraftStats:
        request = draft_pb2.DraftRequest(stats=draft_pb2.StatsRequest())
        return stats_from_proto(await self._sessions.get(session_id).exchange(request, "stats"))

    async def release(self, session_id: str) -> None:
        await self._sessions.release(session_id)

    async def close(self) -> None:
        """Close the channel shared by every ``with_timeout`` client; open sessions are cancelled."""
        await self.channel.close()
