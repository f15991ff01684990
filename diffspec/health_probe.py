"""``python -m diffspec.health_probe HOST:PORT [SERVICE]``: exit 0 iff the server's gRPC health is SERVING.

The container health check of every DiffSpec image (no grpc_health_probe binary to ship).
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

TIMEOUT_S = 3.0


def is_serving(address: str, service: str = "") -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S
            )
        except grpc.RpcError as failure:
            print(f"{address}: {failure.code().name}: {failure.details()}", file=sys.stderr)
            return False
    print(f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print(__doc__, file=sys.stderr)
        return 2
    return 0 if is_serving(*argv) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
