"""The gRPC gateway and the OpenAI-compatible HTTP API over one in-process engine, on loopback ports,
served from an event loop on a thread of its own (so blocking clients can call them from the test)."""

from __future__ import annotations

import asyncio
import threading

import grpc

from diffspec.metrics import ServingMetrics
from diffspec.serving import Loading, StatusInterceptor
from diffspec.settings import DiffSpecSettings
from diffspec.v1 import gateway_pb2_grpc
from gateway.engine import SpeculativeEngine
from gateway.http_api import HttpServer, create_app
from gateway.server import GatewayServicer


class LiveGateway:
    def __init__(self, engine: SpeculativeEngine, settings: DiffSpecSettings) -> None:
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.address, http_address = asyncio.run_coroutine_threadsafe(self._start(settings), self.loop).result(30)
        self.http_base = f"http://{http_address}/v1"

    async def _start(self, settings: DiffSpecSettings) -> tuple[str, str]:
        metrics = ServingMetrics()
        loaded: Loading[SpeculativeEngine] = Loading("engine")
        loaded.set(self.engine)
        self.server = grpc.aio.server(interceptors=[StatusInterceptor(metrics)])
        self.servicer = GatewayServicer(loaded, settings, metrics)
        gateway_pb2_grpc.add_GatewayServicer_to_server(self.servicer, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.http = HttpServer(create_app(loaded, settings, metrics), "127.0.0.1:0", grace_seconds=1.0)
        return f"127.0.0.1:{port}", await self.http.start()

    async def _stop(self) -> None:
        await self.http.stop()
        await self.server.stop(0)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(30)
        self.servicer.tokenizer_pool.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
