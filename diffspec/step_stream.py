"""The client end of a service's ``Step`` stream, for the engine loop's own thread.

One bidirectional call carries every step of one gateway: requests go out through a queue the
call's request iterator drains; replies come back through a reader thread into another queue,
so a reply that does not arrive within ``step_timeout`` (a hung or blackholed peer) ends the
call instead of the loop. A broken call is raised as the typed error of its status and
dropped; the next step opens a fresh call. The service released every session of the old one.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Generic, Iterable, Iterator, TypeVar

import grpc
from google.protobuf.message import Message

from diffspec.errors import DiffSpecError, PeerUnavailable
from diffspec.rpc_status import error_for

Request = TypeVar("Request", bound=Message)
Reply = TypeVar("Reply", bound=Message)
_END = object()  # ends the request iterator: the client is done writing


def unary_call(peer: str, call: Callable[[], Reply]) -> Reply:
    """Make a unary call to ``peer``; a failed call raises its typed error."""
    try:
        return call()
    except grpc.RpcError as failed:
        raise error_for(peer, failed.code(), failed.details()) from None


class StepStream(Generic[Request, Reply]):
    def __init__(self, open_call: Callable[[Iterator[Request]], Iterator[Reply]], peer: str, step_timeout: float) -> None:
        self.open_call = open_call
        self.peer = peer  # e.g. "target service", for messages
        self.step_timeout = step_timeout  # seconds a reply may take
        self._call: grpc.Future | None = None
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._replies: queue.SimpleQueue = queue.SimpleQueue()

    def send(self, requests: Iterable[Request]) -> None:
        if self._call is None:
            self._open()
        for request in requests:
            self._requests.put(request)

    def receive(self) -> Reply:
        """The next reply; a broken, ended or silent call raises (and is dropped)."""
        reply = self.poll(self.step_timeout)
        if reply is None:
            self.close()
            raise PeerUnavailable(f"{self.peer} sent no reply within {self.step_timeout:.0f} s")
        return reply

    def poll(self, timeout: float) -> Reply | None:
        """The next reply if it comes within ``timeout`` seconds (0: only one already here), else None and the
        call stays open, its reply still owed; a broken or ended call raises (and is dropped)."""
        try:
            item = self._replies.get(timeout=timeout) if timeout > 0 else self._replies.get_nowait()
        except queue.Empty:
            return None
        if isinstance(item, Message):
            return item  # type: ignore[return-value]
        self.close()
        raise item

    def close(self) -> None:
        """End the call; the service releases every session opened on it."""
        if self._call is not None:
            self._requests.put(_END)
            self._call.cancel()
            self._call = None

    def _open(self) -> None:
        self._requests, self._replies = queue.SimpleQueue(), queue.SimpleQueue()
        call = self.open_call(_drain(self._requests))
        self._call = call  # type: ignore[assignment]
        threading.Thread(target=self._read, args=(call, self._replies), name=f"{self.peer} replies", daemon=True).start()

    def _read(self, call: Iterator[Reply], replies: queue.SimpleQueue) -> None:
        failure: DiffSpecError
        try:
            for reply in call:
                replies.put(reply)
            failure = PeerUnavailable(f"{self.peer} ended the step stream")
        except grpc.RpcError as failed:
            failure = error_for(self.peer, failed.code(), failed.details())
        replies.put(failure)


def _drain(requests: queue.SimpleQueue) -> Iterator[Message]:
    while (item := requests.get()) is not _END:
        yield item
