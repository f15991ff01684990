"""gRPC load on a gateway with Locust: each user streams ``Gateway/Generate`` calls back to back.

    locust -f bench/locustfile.py --headless -u 4 -r 2 -t 30s --host 127.0.0.1:50051

Every call reports four request events (request_type ``grpc``):

- ``Generate``: the whole call; response_length = tokens received.
- ``time_to_first_token``: ms from sending the request to the first token.
- ``inter_token_latency``: the call's mean ms between tokens after the first.
- ``tokens_per_second``: decode throughput of the call; *its "response time" column is
  tokens/s, not ms* (Locust's statistics have no other numeric column).

Environment: ``DIFFSPEC_LOCUST_PROMPTS`` (JSONL with a ``text`` key; default
``../shared/data/shortctx_eval.jsonl``), ``DIFFSPEC_LOCUST_PROMPT_CHARS`` (keep the last N
characters of each prompt, default 2000), ``DIFFSPEC_LOCUST_MAX_NEW_TOKENS`` (default 64),
``DIFFSPEC_LOCUST_POLICY`` (default: the server's), ``DIFFSPEC_LOCUST_TIMEOUT_S`` (default 120),
``DIFFSPEC_LOCUST_CLIENTS``: ``shared`` (default: every call is one client, so a repeated prompt finds the
target's and the draft's prefix caches warm, as repeated traffic does in serving) or ``per-call`` (each call
declares a client of its own in ``x-diffspec-client``: the caches are scoped by client, so every prompt is
computed cold and the figures do not depend on how often the prompts repeat).
"""

from __future__ import annotations

# gevent-friendly grpc before anything opens a channel (as Locust's own gRPC example does)
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402

import grpc  # noqa: E402
from locust import User, constant, task  # noqa: E402

from diffspec.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPTS_PATH = Path(
    os.environ.get("DIFFSPEC_LOCUST_PROMPTS", REPO_ROOT.parent / "shared" / "data" / "shortctx_eval.jsonl")
)
PROMPT_CHARS = int(os.environ.get("DIFFSPEC_LOCUST_PROMPT_CHARS", "2000"))
MAX_NEW_TOKENS = int(os.environ.get("DIFFSPEC_LOCUST_MAX_NEW_TOKENS", "64"))
POLICY = os.environ.get("DIFFSPEC_LOCUST_POLICY", "")
TIMEOUT_S = float(os.environ.get("DIFFSPEC_LOCUST_TIMEOUT_S", "120"))
CLIENTS = os.environ.get("DIFFSPEC_LOCUST_CLIENTS", "shared")
if CLIENTS not in ("shared", "per-call"):
    raise ValueError(f"DIFFSPEC_LOCUST_CLIENTS must be 'shared' or 'per-call', not {CLIENTS!r}")
CLIENT_HEADER = "x-diffspec-client"  # gateway.quota's; the load generator imports nothing of the gateway


def load_prompts(path: Path, keep_chars: int) -> list[str]:
    """Each prompt's last ``keep_chars`` characters, without the partial line a cut leaves at the front."""
    prompts = []
    for line in path.read_text().splitlines():
        text = json.loads(line)["text"]
        tail = text[-keep_chars:]
        if len(text) > keep_chars and "\n" in tail:
            tail = tail.split("\n", 1)[1] or tail
        prompts.append(tail)
    return prompts


PROMPTS = load_prompts(PROMPTS_PATH, PROMPT_CHARS)


class GenerateUser(User):
    wait_time = constant(0)

    def on_start(self) -> None:
        self.channel = grpc.insecure_channel(self.host)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    def on_stop(self) -> None:
        self.channel.close()

    @task
    def generate(self) -> None:
        request = gateway_pb2.GenerateRequest(text=random.choice(PROMPTS), max_new_tokens=MAX_NEW_TOKENS, policy=POLICY)
        start = time.perf_counter()
        first = last = None
        tokens = 0
        try:
            for response in self.stub.Generate(request, timeout=TIMEOUT_S, metadata=self._call_metadata()):
                if response.token_ids:
                    last = time.perf_counter()
                    first = first or last
                    tokens += len(response.token_ids)
        except grpc.RpcError as failure:
            self._report("Generate", (time.perf_counter() - start) * 1000, tokens, failure)
            return
        self._report("Generate", (time.perf_counter() - start) * 1000, tokens)
        if first is None:
            return
        self._report("time_to_first_token", (first - start) * 1000, 1)
        if tokens > 1 and last > first:
            self._report("inter_token_latency", (last - first) * 1000 / (tokens - 1), tokens - 1)
            self._report("tokens_per_second", (tokens - 1) / (last - first), tokens - 1)

    @staticmethod
    def _call_metadata() -> tuple[tuple[str, str], ...]:
        """The call's client: none declared (the caller's host, shared by every call) or a fresh one."""
        return ((CLIENT_HEADER, f"locust-{uuid.uuid4().hex[:12]}"),) if CLIENTS == "per-call" else ()

    def _report(self, name: str, value: float, length: int, failure: Exception | None = None) -> None:
        self.environment.events.request.fire(
            request_type="grpc", name=name, response_time=value, response_length=length, exception=failure, context={}
        )
