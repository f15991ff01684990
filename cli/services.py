"""The gRPC services of one ``diffspec serve`` process, wired to their models.

``all`` (the embedded default) runs the gateway's engine over the target and the draft in
this process, on one port. ``target`` and ``draft`` serve one model each; ``gateway`` runs the
engine over them at ``--target`` / ``--draft`` (in process when unset). With ``http_listen`` set,
``all`` and ``gateway`` also serve the OpenAI-compatible HTTP API from the same engine, started
before the models load and stopped after the gRPC drain.

Each role imports only what it serves: a gateway over a remote target and a remote draft loads
no torch (``docker/gateway.Dockerfile`` installs none). A model in this process warms up before its
service turns ready (``warm_up``): the target records its step graphs, the draft proposes the trees
its policies start from, so no request pays for a compile or a capture.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from diffspec.heap import freeze_startup_heap, thaw_heap
from diffspec.serving import Loading, ServiceHost
from diffspec.settings import DiffSpecSettings

if TYPE_CHECKING:
    from gateway.engine import SpeculativeEngine

Load = Callable[[], Awaitable[None]]
log = logging.getLogger("diffspec.serve")


class WarmsUp(Protocol):
    def warm_up(self) -> int: ...  # how many graphs or proposals it made


def add_target(host: ServiceHost, settings: DiffSpecSettings) -> Load:
    from diffspec.v1 import target_pb2_grpc
    from target_service import server as target_server
    from target_service.runtime import TargetRuntime

    target: Loading[TargetRuntime] = Loading("the target model")
    servicer = target_server.TargetServicer(target, settings, host.metrics)
    host.add(servicer, target_pb2_grpc.add_TargetServicer_to_server, target_server.SERVICE_NAME)

    async def load() -> None:
        loaded = await asyncio.to_thread(TargetRuntime, settings)
        if settings.warm_up:
            await warm_up(loaded, "the target's step graphs recorded")
        target.set(loaded)
        host.metrics.watch_target(loaded)

    return load


def add_draft(host: ServiceHost, settings: DiffSpecSettings) -> Load:
    from diffspec.v1 import draft_pb2_grpc
    from draft_service import server as draft_server
    from draft_service.inprocess import load_draft_runtime
    from draft_service.runtime import DraftRuntime

    draft: Loading[DraftRuntime] = Loading("the draft model")
    servicer = draft_server.DraftServicer(draft, settings, host.metrics)
    host.add(servicer, draft_pb2_grpc.add_DraftServicer_to_server, draft_server.SERVICE_NAME)

    async def load() -> None:
        loaded = await asyncio.to_thread(load_draft_runtime, settings)
        if settings.warm_up:
            await warm_up(loaded, "the draft's first trees proposed")
        draft.set(loaded)
        host.metrics.watch_draft(loaded)

    return load


def add_gateway(host: ServiceHost, settings: DiffSpecSettings, engine: Loading[SpeculativeEngine]) -> Load:
    """``engine``: filled once loaded (the backends in process unless their addresses are set)."""
    from diffspec.v1 import gateway_pb2_grpc
    from draft_service.grpc_client import RemoteDraft
    from gateway import server as gateway_server
    from gateway.assembly import load_engine
    from target_service.grpc_client import RemoteTarget

    servicer = gateway_server.GatewayServicer(engine, settings, host.metrics)
    host.add(servicer, gateway_pb2_grpc.add_GatewayServicer_to_server, gateway_server.SERVICE_NAME)
    if settings.target_address:
        host.watch("the target", servicer.target_answers, settings.peer_health_seconds)

    async def load() -> None:
        loaded = await load_engine(settings)
        if settings.warm_up:  # the backends in this process; a service over gRPC warms itself
            if not isinstance(loaded.target, RemoteTarget):
                await warm_up(loaded.target, "the target's step graphs recorded")
            if loaded.draft is not None and not isinstance(loaded.draft, RemoteDraft):
                await warm_up(loaded.draft, "the draft's first trees proposed")
                if not isinstance(loaded.target, RemoteTarget):
                    seed_verify_costs(loaded.target, loaded.draft)
        engine.set(loaded)
        if isinstance(loaded.target, RemoteTarget):
            host.metrics.watch_wire("target", loaded.target.wire)
        else:
            host.metrics.watch_target(loaded.target)
        if isinstance(loaded.draft, RemoteDraft):
            host.metrics.watch_wire("draft", loaded.draft.wire)
        elif loaded.draft is not None:
            host.metrics.watch_draft(loaded.draft)

    return load


def seed_verify_costs(target: object, draft: object) -> None:
    """Hand an in-process draft the verify costs its in-process target timed at warm-up: the planner's
    start (imported here: a gateway over gRPC runs without torch)."""
    from draft_service.runtime import DraftRuntime
    from target_service.runtime import TargetRuntime

    if isinstance(draft, DraftRuntime) and isinstance(target, TargetRuntime):
        draft.step_cost.seed_verify(target.verify_costs())


async def warm_up(runtime: WarmsUp, what: str) -> None:
    """Run ``runtime``'s warm-up in a worker thread before it serves, and say what it did in one log line."""
    started = time.perf_counter()
    count = await asyncio.to_thread(runtime.warm_up)
    log.info("warm-up: %d of %s in %.1f s", count, what, time.perf_counter() - started)


async def serve(role: str, settings: DiffSpecSettings) -> None:
    host = ServiceHost(settings, role)
    engine: Loading[SpeculativeEngine] = Loading("the gateway's engine")
    if role == "target":
        load_models = add_target(host, settings)
    elif role == "draft":
        load_models = add_draft(host, settings)
    else:
        load_models = add_gateway(host, settings, engine)
    http = None
    if role in ("all", "gateway") and settings.http_listen:
        from gateway.http_api import HttpServer, create_app

        app = create_app(engine, settings, host.metrics, host.readiness)
        http = HttpServer(
            app, settings.http_listen, settings.shutdown_grace_seconds, settings.tls_cert, settings.tls_key,
            settings.tls_client_ca,
        )  # fmt: skip

    async def load() -> None:
        if http is not None:  # up while the models load: /health answers, /ready says 503
            address = await http.start()
            print(f"diffspec {role} OpenAI-compatible HTTP API on {http.scheme}://{address}/v1", flush=True)
        await load_models()
        log.info("froze %d objects of startup out of the collector's walks", freeze_startup_heap())

    async def close() -> None:
        if http is not None:
            await http.stop()
        if role in ("all", "gateway"):
            await asyncio.to_thread(engine.get().close)
        thaw_heap()  # what the models leave behind can be freed again

    try:
        await host.run(load, close)
    finally:
        if http is not None:  # a failed or interrupted load skips close()
            await http.stop()
