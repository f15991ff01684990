"""Client-side call plumbing: one bidirectional ``Session`` call per remote session, and unary calls.

Requests and replies alternate on a session's stream. A failed call (peer gone, stream broken,
deadline passed, request rejected) is raised as the typed error ``rpc_status.error_for``
gives, so callers handle a remote service exactly like an in-process one. Cancelling the
awaiting task cancels the call (grpc.aio does that inside ``read``/``write``), and a
cancelled or broken stream has already released the remote session.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Generic, Iterable, TypeVar

import grpc
from google.protobuf.message import Message

from diffspec.errors import DiffSpecError, InvalidRequest
from diffspec.rpc_status import error_for

log = logging.getLogger(__name__)

Request = TypeVar("Request", bound=Message)
Reply = TypeVar("Reply", bound=Message)


async def unary_call(peer: str, call: Awaitable[Reply]) -> Reply:
    """Await a unary call to ``peer``; a failed call raises its typed error."""
    try:
        return await call
    except grpc.aio.AioRpcError as failed:
        raise error_for(peer, failed.code(), failed.details()) from None


class SessionStream(Generic[Request]):
    def __init__(self, call: grpc.aio.StreamStreamCall, peer: str) -> None:
        self.call = call
        self.peer = peer  # e.g. "target service", for messages

    async def send(self, requests: Iterable[Request]) -> None:
        """Write requests in order (a generator is consumed lazily, one message in memory at a time)."""
        try:
            for request in requests:
                await self.call.write(request)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            raise await self._failure() from None

    async def receive(self, kind: str) -> Message:
        """The next reply, which must be of oneof ``kind``; returns that field."""
        try:
            reply = await self.call.read()
        except grpc.aio.AioRpcError:
            raise await self._failure() from None
        if reply is grpc.aio.EOF:
            raise await self._failure()
        if reply.WhichOneof("kind") != kind:
            self.call.cancel()
            raise error_for(self.peer, None, f"protocol error: expected a {kind} reply, got {reply.WhichOneof('kind')}")
        return getattr(reply, kind)

    async def exchange(self, request: Request, kind: str) -> Message:
        await self.send([request])
        return await self.receive(kind)

    async def _failure(self) -> DiffSpecError:
        code = await self.call.code()
        details = await self.call.details()
        if code == grpc.StatusCode.OK:
            return error_for(self.peer, None, "the session stream ended early")
        return error_for(self.peer, code, details)


class RemoteSessions(Generic[Request]):
    """Session id -> its open stream, for one client of one remote service."""

    def __init__(self, peer: str, open_call: Callable[[], grpc.aio.StreamStreamCall], release: Request) -> None:
        self.peer = peer
        self._open_call = open_call
        self._release = release  # the request that releases a session
        self._streams: dict[str, SessionStream[Request]] = {}

    def open(self, session_id: str) -> SessionStream[Request]:
        if session_id in self._streams:
            raise InvalidRequest(f"{self.peer} session {session_id!r} already exists")
        stream: SessionStream[Request] = SessionStream(self._open_call(), self.peer)
        self._streams[session_id] = stream
        return stream

    def get(self, session_id: str) -> SessionStream[Request]:
        stream = self._streams.get(session_id)
        if stream is None:
            raise InvalidRequest(f"unknown {self.peer} session {session_id!r}")
        return stream

    async def release(self, session_id: str) -> None:
        """Release the remote session and end its stream; an unknown or broken session is a no-op."""
        stream = self._streams.pop(session_id, None)
        if stream is None or stream.call.done():
            return
        try:
            await stream.exchange(self._release, "release")
            await stream.call.done_writing()
            await stream.call.code()
        except DiffSpecError as failure:  # the stream is gone, and with it the session
            log.debug("release of %s session %s: %s", self.peer, session_id, failure)
        finally:
            stream.call.cancel()  # no-op once the call has ended
