"""The README's first command (past its pip installs), run as written on a free port: a real
continuation and the speed line; a bad model path or a port in use stops it within seconds."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from diffspec.settings import REPO_ROOT

README_PORT = "50051"


def first_command(port: int) -> str:
    """Line 1's ``{ serve; probe; generate; kill; }`` group, moved to ``port``."""
    line = (REPO_ROOT / "README.md").read_text().split("```bash\n", 1)[1].splitlines()[0]
    group = line[line.index("{ diffspec serve"):]
    assert group.count(README_PORT) == 2  # the server's default address, given to the probe and to generate
    return group.replace(README_PORT, str(port))  # the server moves there by DIFFSPEC_LISTEN


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_first_command(port: int, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    run = subprocess.run(
        ["bash", "-c", first_command(port)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "DIFFSPEC_LISTEN": f"127.0.0.1:{port}", **env},
    )
    return run, time.monotonic() - started


def test_prints_a_continuation_and_the_speed_line():
    run, _ = run_first_command(free_port())
    assert run.stdout.count("ready: serving on") == 1, run.stderr
    assert "\n        self.items.append(item)\n" in run.stdout
    speed = [line for line in run.stderr.splitlines() if " tokens/s, tau " in line]
    assert len(speed) == 1 and "x Auto (" in speed[0] and speed[0].endswith("same tokens)"), run.stderr


def test_a_bad_model_path_stops_it_with_the_servers_error():
    run, seconds = run_first_command(free_port(), DIFFSPEC_BASE_MODEL="/no/such/model")
    assert "/no/such/model does not exist" in run.stderr and "exited before serving" in run.stderr
    assert "tokens/s" not in run.stderr and seconds < 60


def test_a_port_in_use_stops_it_and_no_other_server_answers():
    """Another gRPC server (SERVING, port reuse on, as grpc sets by default) holds the port."""
    port = free_port()
    ready = threading.Event()
    stop = threading.Event()

    def other_server() -> None:
        async def serve() -> None:
            server = grpc.aio.server()
            servicer = health_aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
            server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.1)
            await server.stop(0)

        asyncio.run(serve())

    thread = threading.Thread(target=other_server)
    thread.start()
    try:
        assert ready.wait(10)
        run, seconds = run_first_command(port)
    finally:
        stop.set()
        thread.join(10)
    assert f"cannot listen on 127.0.0.1:{port}: in use" in run.stderr and "exited before serving" in run.stderr
    assert "tokens/s" not in run.stderr and seconds < 60
