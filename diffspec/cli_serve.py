"""``diffspec serve [all|target|draft|gateway]``: the gRPC services of one process.

``all`` (the embedded default) runs the target, the draft and the gateway in one process
on one port: the gateway calls the in-process backends directly, and the Target and Draft
services are on the same server for outside callers. ``target`` and ``draft`` serve one
model each; ``gateway`` calls them at ``--target`` / ``--draft`` (in process when unset).
"""

from __future__ import annotations

import asyncio

from diffspec.errors import InvalidRequest
from diffspec.serving import Loading, ServiceHost
from diffspec.settings import DiffSpecSettings
from diffspec.v1 import draft_pb2_grpc, gateway_pb2_grpc, target_pb2_grpc
from draft_service import server as draft_server
from draft_service.inprocess import InProcessDraft
from gateway import server as gateway_server
from gateway.assembly import Backends, inprocess_target, load_backends
from target_service import server as target_server
from target_service.inprocess import InProcessTarget


def run_serve(role: str, settings: DiffSpecSettings) -> int:
    if role == "all" and (settings.target_address or settings.draft_address):
        raise InvalidRequest(
            "`serve all` runs the target and the draft in process; "
            "for remote ones run `serve gateway --target HOST:PORT --draft HOST:PORT`"
        )
    asyncio.run(_serve(role, settings))
    return 0


async def _serve(role: str, settings: DiffSpecSettings) -> None:
    host = ServiceHost(settings, role)
    target: Loading[InProcessTarget] = Loading("the target model")
    draft: Loading[InProcessDraft] = Loading("the draft model")
    backends: Loading[Backends] = Loading("the gateway's backends")
    if role in ("all", "target"):
        servicer = target_server.TargetServicer(target, settings, host.metrics)
        host.add(servicer, target_pb2_grpc.add_TargetServicer_to_server, target_server.SERVICE_NAME)
    if role == "draft" or (role == "all" and settings.draft_model.exists()):
        servicer = draft_server.DraftServicer(draft, settings, host.metrics)
        host.add(servicer, draft_pb2_grpc.add_DraftServicer_to_server, draft_server.SERVICE_NAME)
    if role in ("all", "gateway"):
        servicer = gateway_server.GatewayServicer(backends, settings, host.metrics)
        host.add(servicer, gateway_pb2_grpc.add_GatewayServicer_to_server, gateway_server.SERVICE_NAME)

    async def load() -> None:
        if role == "target":
            _watch_target(host, target, await asyncio.to_thread(inprocess_target, settings))
        elif role == "draft":
            _watch_draft(host, draft, await asyncio.to_thread(InProcessDraft.from_settings, settings))
        else:
            loaded = await load_backends(settings)
            backends.set(loaded)
            if isinstance(loaded.target, InProcessTarget):
                _watch_target(host, target, loaded.target)
            if isinstance(loaded.draft, InProcessDraft):
                _watch_draft(host, draft, loaded.draft)

    async def close() -> None:
        if role in ("all", "gateway"):
            await backends.get().close()

    await host.run(load, close)


def _watch_target(host: ServiceHost, slot: Loading[InProcessTarget], target: InProcessTarget) -> None:
    slot.set(target)
    host.metrics.watch_target(target)


def _watch_draft(host: ServiceHost, slot: Loading[InProcessDraft], draft: InProcessDraft) -> None:
    slot.set(draft)
    host.metrics.watch_draft(draft)
