"""The gRPC gateway servicer over an in-process engine on a loopback port, with the interceptors a
``diffspec serve`` process installs (status mapping, and the bearer-token check when the settings
ask for one), its event loop on a thread of its own so blocking clients can call it from a test."""

from __future__ import annotations

import asyncio
import threading

import grpc

from diffspec.auth import ApiKeys, BearerTokenInterceptor
from diffspec.metrics import ServingMetrics
from diffspec.serving import Loading, StatusInterceptor
from diffspec.settings import DiffSpecSettings
from diffspec.v1 import gateway_pb2_grpc
from gateway.engine import SpeculativeEngine
from gateway.server import GatewayServicer


class InProcessGateway:
    def __init__(self, engine: SpeculativeEngine, settings: DiffSpecSettings) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.address = asyncio.run_coroutine_threadsafe(self._start(engine, settings), self.loop).result(30)

    async def _start(self, engine: SpeculativeEngine, settings: DiffSpecSettings) -> str:
        metrics = ServingMetrics()
        interceptors: list[grpc.aio.ServerInterceptor] = [StatusInterceptor(metrics)]
        keys = ApiKeys.for_role(settings, "gateway")
        if keys.required:
            interceptors.append(BearerTokenInterceptor(keys))
        self.server = grpc.aio.server(interceptors=interceptors)
        loaded: Loading[SpeculativeEngine] = Loading("engine")
        loaded.set(engine)
        self.servicer = GatewayServicer(loaded, settings, metrics)
        gateway_pb2_grpc.add_GatewayServicer_to_server(self.servicer, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return f"127.0.0.1:{port}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(30)
        self.servicer.tokenizer_pool.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
