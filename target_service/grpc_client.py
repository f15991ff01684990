"""``RemoteTarget``: the ``TargetBackend`` protocol over gRPC, one ``Session`` stream per session id.

A target that cannot be reached, or whose stream breaks, raises ``PeerUnavailable``; a
request it rejects raises ``InvalidRequest`` / ``ResourceExhausted`` as in process. Closing
or cancelling a session's stream releases it on the target.
"""

from __future__ import annotations

import grpc

from diffspec.grpc_options import open_channel
from diffspec.rpc_client import RemoteSessions, unary_call
from diffspec.sampling import SamplingParams
from diffspec.settings import DiffSpecSettings
from diffspec.tree import DraftTree
from diffspec.v1 import target_pb2, target_pb2_grpc
from diffspec.wire import RowJoiner, tree_to_proto
from target_service.backend import (
    PrefillProgress,
    PrefillResult,
    TargetInfo,
    VerifyResult,
)
from target_service.messages import info_from_proto, sampling_to_proto, step_from_proto

PEER = "target service"
_RELEASE = target_pb2.TargetRequest(release=target_pb2.TargetReleaseRequest())


class RemoteTarget:
    def __init__(self, channel: grpc.aio.Channel, timeout: float | None = None) -> None:
        self.channel = channel
        self.timeout = timeout  # seconds each call may take, from its start (None = no deadline)
        self._stub = target_pb2_grpc.TargetStub(channel)
        self._sessions: RemoteSessions[target_pb2.TargetRequest] = RemoteSessions(
            PEER, lambda: self._stub.Session(timeout=timeout), _RELEASE
        )

    @classmethod
    def connect(cls, address: str, settings: DiffSpecSettings) -> RemoteTarget:
        return cls(open_channel(address, settings))

    def with_timeout(self, timeout: float | None) -> RemoteTarget:
        """A client on the same channel whose calls end by ``timeout`` seconds from now: one per request."""
        return RemoteTarget(self.channel, timeout)

    async def prefill(
        self,
        session_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        want_features: bool,
        progress: PrefillProgress | None = None,  # not reported over the wire
    ) -> PrefillResult:
        stream = self._sessions.open(session_id)
        request = target_pb2.PrefillRequest(
            prompt_ids=prompt_ids, sampling=sampling_to_proto(sampling), want_features=want_features
        )
        reply = await stream.exchange(target_pb2.TargetRequest(prefill=request), "prefill")
        features = None
        if want_features:
            joiner = RowJoiner(total_rows=len(prompt_ids), row_width=None)
            while not joiner.complete:
                joiner.add(await stream.receive("features"))
            features = joiner.tensor()
        return PrefillResult(
            first_token=reply.first_token, features=features, num_cached_tokens=reply.num_cached_tokens
        )

    async def verify(self, session_id: str, tree: DraftTree) -> VerifyResult:
        request = target_pb2.TargetRequest(verify=target_pb2.VerifyRequest(tree=tree_to_proto(tree)))
        return step_from_proto(await self._sessions.get(session_id).exchange(request, "step"))

    async def decode(self, session_id: str) -> VerifyResult:
        request = target_pb2.TargetRequest(decode=target_pb2.DecodeRequest())
        return step_from_proto(await self._sessions.get(session_id).exchange(request, "step"))

    async def release(self, session_id: str) -> None:
        await self._sessions.release(session_id)

    async def info(self) -> TargetInfo:
        return info_from_proto(
            await unary_call(PEER, self._stub.Info(target_pb2.TargetInfoRequest(), timeout=self.timeout))
        )

    async def close(self) -> None:
        """Close the channel shared by every ``with_timeout`` client; open sessions are cancelled."""
        await self.channel.close()
