"""``python -m diffspec.health_probe HOST:PORT [SERVICE] [--wait-for PID]``: exit 0 iff the server's
gRPC health is SERVING.

The container health check of every DiffSpec image (no grpc_health_probe binary to ship); it
speaks TLS when ``DIFFSPEC_TLS_CA`` is set, with ``DIFFSPEC_TLS_CERT``/``DIFFSPEC_TLS_KEY`` as its
client certificate for a server that asks for one (mutual TLS), as the images set them. With
``--wait-for PID`` it waits for the server that process ``PID`` started, and fails as soon as
that process exits: a server answers SERVING for its own process's health name too, so a probe
never mistakes another server on the same port for the one it waits for.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from diffspec.grpc_options import open_blocking_channel
from diffspec.settings import DiffSpecSettings

TIMEOUT_S = 3.0
POLL_S = 0.5


def process_service(pid: int) -> str:
    """The health name a server marks SERVING for the process it runs in."""
    return f"diffspec.process/{pid}"


def check(address: str, service: str = "") -> tuple[bool, str]:
    """(SERVING or not, what the server said or why it could not be asked). The channel is the settings'
    (``DIFFSPEC_TLS_CA`` and the others from the environment), so a container's probe speaks its server's TLS."""
    with open_blocking_channel(address, DiffSpecSettings()) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S
            )
        except grpc.RpcError as failure:
            return False, f"{address}: {failure.code().name}: {failure.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address}: {status}"


def is_serving(address: str, service: str = "") -> bool:
    return check(address, service)[0]


def is_alive(pid: int) -> bool:
    """Running, not exited (a zombie, exited but not yet reaped by its parent, counts as exited)."""
    stat = Path(f"/proc/{pid}/stat")
    if stat.exists():
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_for(address: str, pid: int, timeout_s: float) -> tuple[bool, str]:
    """Poll until the server of process ``pid`` is SERVING; give up when that process exits."""
    deadline = time.monotonic() + timeout_s
    said = "never asked"
    while time.monotonic() < deadline:
        if not is_alive(pid):
            return False, f"{address}: the server (process {pid}) exited before serving"
        serving, said = check(address, process_service(pid))
        if serving:
            return True, said
        time.sleep(POLL_S)
    return False, f"{address}: not serving after {timeout_s:.0f} s ({said})"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m diffspec.health_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("address", metavar="HOST:PORT")
    parser.add_argument("service", nargs="?", default="", help="a service name ('' = the whole server)")
    parser.add_argument("--wait-for", type=int, metavar="PID", help="wait for the server that process PID runs")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds --wait-for waits (default: 900)")
    args = parser.parse_args(argv)
    if args.wait_for is None:
        serving, said = check(args.address, args.service)
    else:
        serving, said = wait_for(args.address, args.wait_for, args.timeout)
    print(said, file=sys.stdout if serving else sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
