"""health_probe --wait-for: it waits for the server of one process, never another on the same port."""

from __future__ import annotations

import os
import subprocess
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from diffspec.health_probe import process_service, wait_for


def health_server(*serving: str) -> tuple[grpc.Server, str]:
    """A server whose health is SERVING for the names ``serving`` only."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    for name in serving:
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    server.start()
    return server, f"127.0.0.1:{port}"


def test_it_succeeds_once_the_processs_own_server_serves():
    server, address = health_server("", process_service(os.getpid()))
    try:
        assert wait_for(address, os.getpid(), timeout_s=10) == (True, f"{address}: SERVING")
    finally:
        server.stop(0)


def test_another_server_on_the_port_does_not_count():
    server, address = health_server("")  # SERVING, but for some other process
    try:
        serving, said = wait_for(address, os.getpid(), timeout_s=1.5)
    finally:
        server.stop(0)
    assert not serving and "not serving after 2 s" in said and "NOT_FOUND" in said


def test_it_gives_up_as_soon_as_the_process_exits():
    exited = subprocess.Popen(["true"])  # not reaped: a zombie counts as exited
    time.sleep(0.2)
    started = time.monotonic()
    serving, said = wait_for("127.0.0.1:1", exited.pid, timeout_s=60)
    assert not serving and f"(process {exited.pid}) exited before serving" in said
    assert time.monotonic() - started < 5
    exited.wait()
