"""Attack a live gateway as a hostile client would, while an innocent client streams beside it.

For ``--seconds``, from threads of their own: mutated ``GenerateRequest`` bytes and out-of-range
fields (``mutate``), a flood of long streams from one client (``flood``), streams cancelled during
prefill or decode (``cancel``), streams read one message per half second (``slow``), and texts past
the context's character bound or long ``Tokenize`` calls (``oversize``). An
``innocent`` client runs short generations one after another, first alone (the baseline), then
under the attack. When the attack stops, the server's gauges must come back: every KV page free,
no target or draft session, no generation in flight.

Reported (JSON): each attacker's calls by status code, the innocent latencies (p50/p95) alone and
under attack, how long the gauges took to come back, what is still held (``leaks``), and
``findings``: INTERNAL or UNKNOWN statuses, innocent failures, leaks. Exit status 1 with findings.

    python -m bench.adversarial --spawn all --seconds 30 --out bench/results/adversarial.json
    python -m bench.adversarial --gateway 127.0.0.1:50051 --metrics 127.0.0.1:9100 --metrics ...
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from diffspec.grpc_options import call_metadata, open_blocking_channel
from diffspec.settings import DiffSpecSettings
from diffspec.v1 import gateway_pb2, gateway_pb2_grpc

GENERATE = "/diffspec.v1.Gateway/Generate"
TOKENIZE = "/diffspec.v1.Gateway/Tokenize"
MAX_CHARS_PER_TOKEN = 16  # gateway/server.py's bound: a longer text per context token is refused unread
CLIENT_HEADER = "x-diffspec-client"
BAD_STATUSES = ("INTERNAL", "UNKNOWN")
SETTLE_TIMEOUT_S = 30.0
SPAWN_FLAGS = ["--num-pages", "512", "--max-sessions", "16", "--client-max-requests", "4"]


@dataclass(frozen=True)
class AttackConfig:
    seconds: float = 20.0  # length of the attack
    seed: int = 0
    prompt: str = "def fibonacci(n):"
    innocent_tokens: int = 16  # max_new_tokens of each innocent request
    innocent_baseline: int = 5  # innocent requests before the attack
    flood_streams: int = 8
    flood_tokens: int = 256
    cancel_threads: int = 2
    mutate_threads: int = 2
    slow_streams: int = 2
    oversize_threads: int = 1
    call_timeout_s: float = 20.0  # deadline of every attacking call


@dataclass(frozen=True)
class Gauges:
    free_pages: int
    total_pages: int
    target_sessions: int
    draft_sessions: int
    active_generations: int

    @property
    def held(self) -> dict[str, int]:
        """What is still taken; empty once everything came back."""
        held = {
            "kv_pages": self.total_pages - self.free_pages,
            "target_sessions": self.target_sessions,
            "draft_sessions": self.draft_sessions,
            "active_generations": self.active_generations,
        }
        return {name: count for name, count in held.items() if count}


@dataclass
class AttackReport:
    outcomes: dict[str, Counter[str]] = field(default_factory=dict)  # attacker -> status name -> calls
    innocent_alone_s: list[float] = field(default_factory=list)
    innocent_attacked_s: list[float] = field(default_factory=list)
    settle_seconds: float = 0.0  # from the attack's end until the gauges came back
    leaks: dict[str, int] = field(default_factory=dict)

    @property
    def findings(self) -> list[str]:
        found = [
            f"{attacker}: {calls[status]} calls ended {status}"
            for attacker, calls in self.outcomes.items()
            for status in BAD_STATUSES
            if calls[status]
        ]
        innocent = self.outcomes.get("innocent", Counter())
        found += [f"innocent: {n} calls ended {status}" for status, n in innocent.items() if status != "OK"]
        found += [f"still held after the attack: {name} = {n}" for name, n in self.leaks.items()]
        return found

    def to_dict(self) -> dict:
        return {
            "outcomes": {attacker: dict(calls) for attacker, calls in self.outcomes.items()},
            "innocent_alone": _latency(self.innocent_alone_s),
            "innocent_attacked": _latency(self.innocent_attacked_s),
            "settle_seconds": round(self.settle_seconds, 3),
            "leaks": self.leaks,
            "findings": self.findings,
        }


def _latency(seconds: list[float]) -> dict[str, float]:
    if not seconds:
        return {"requests": 0}
    ordered = sorted(seconds)
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    return {"requests": len(ordered), "p50_s": round(statistics.median(ordered), 4), "p95_s": round(p95, 4)}


class Attack:
    """The attackers and the innocent client over one channel; every call's status is counted."""

    def __init__(self, channel: grpc.Channel, metadata: tuple[tuple[str, str], ...], config: AttackConfig) -> None:
        self.config = config
        self.metadata = metadata
        self.generate = channel.unary_stream(
            GENERATE, request_serializer=lambda raw: raw, response_deserializer=gateway_pb2.GenerateResponse.FromString
        )
        self.tokenize = channel.unary_unary(
            TOKENIZE, request_serializer=lambda raw: raw, response_deserializer=gateway_pb2.TokenizeResponse.FromString
        )
        info = gateway_pb2_grpc.GatewayStub(channel).ModelInfo(gateway_pb2.ModelInfoRequest(), metadata=metadata)
        self.max_chars = MAX_CHARS_PER_TOKEN * info.max_context  # the longest text the gateway tokenizes
        self.report = AttackReport()
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._calls: set[grpc.Call] = set()  # in flight, cancelled when the attack stops

    def run(self, read_gauges: Callable[[], Gauges]) -> AttackReport:
        config = self.config
        self.report.innocent_alone_s = [self._innocent_call() for _ in range(config.innocent_baseline)]
        attackers = [
            *(self._loop("flood", self._flood, i) for i in range(config.flood_streams)),
            *(self._loop("cancel", self._cancel, i) for i in range(config.cancel_threads)),
            *(self._loop("mutate", self._mutate, i) for i in range(config.mutate_threads)),
            *(self._loop("slow", self._slow, i) for i in range(config.slow_streams)),
            *(self._loop("oversize", self._oversize, i) for i in range(config.oversize_threads)),
        ]
        for thread in attackers:
            thread.start()
        ends = time.monotonic() + config.seconds
        while time.monotonic() < ends:
            self.report.innocent_attacked_s.append(self._innocent_call())
        self.stop.set()
        with self._lock:
            for call in self._calls:
                call.cancel()
        for thread in attackers:
            thread.join()
        self._settle(read_gauges)
        return self.report

    # -- the clients -----------------------------------------------------------------------------

    def _loop(self, name: str, attack: Callable[[random.Random], None], index: int) -> threading.Thread:
        rng = random.Random(f"{self.config.seed}/{name}/{index}")

        def body() -> None:
            while not self.stop.is_set():
                attack(rng)

        return threading.Thread(target=body, name=f"attack-{name}-{index}", daemon=True)

    def _innocent_call(self) -> float:
        started = time.perf_counter()
        request = gateway_pb2.GenerateRequest(text=self.config.prompt, max_new_tokens=self.config.innocent_tokens)
        self._call("innocent", request.SerializeToString(), "innocent")
        return time.perf_counter() - started

    def _flood(self, rng: random.Random) -> None:
        request = gateway_pb2.GenerateRequest(text=self.config.prompt, max_new_tokens=self.config.flood_tokens)
        if self._call("flood", request.SerializeToString(), "flood") == "RESOURCE_EXHAUSTED":
            time.sleep(0.05)  # as often as a client with a little backoff, not a spin

    def _cancel(self, rng: random.Random) -> None:
        """Leave after 0-3 messages: in the queue, during prefill, or while decoding."""
        request = gateway_pb2.GenerateRequest(text=self.config.prompt * rng.randint(1, 40), max_new_tokens=200)
        self._call("cancel", request.SerializeToString(), f"cancel-{rng.random()}", read_at_most=rng.randint(0, 3))

    def _slow(self, rng: random.Random) -> None:
        request = gateway_pb2.GenerateRequest(text=self.config.prompt, max_new_tokens=64)
        self._call("slow", request.SerializeToString(), "slow", pause_s=0.5)

    def _mutate(self, rng: random.Random) -> None:
        """A request with one bad field, or a valid one's bytes with a few flipped."""
        raw = mutated_request(rng)
        self._call("mutate", raw, f"mutate-{rng.randint(0, 3)}", timeout=2.0)

    def _oversize(self, rng: random.Random) -> None:
        """A text one character past the bound (refused unread), or a long Tokenize within it (admitted on
        the tokenizer pool, or refused while the pool is full)."""
        if rng.random() < 0.5:
            request = gateway_pb2.GenerateRequest(text="x" * (self.max_chars + 1), max_new_tokens=8)
            self._call("oversize", request.SerializeToString(), "oversize")
            return
        raw = gateway_pb2.TokenizeRequest(text="def f(x): return x\n" * (self.max_chars // 40)).SerializeToString()
        metadata = (*self.metadata, (CLIENT_HEADER, "oversize"))
        status = "OK"
        try:
            self.tokenize(raw, timeout=self.config.call_timeout_s, metadata=metadata)
        except grpc.RpcError as ended:
            status = ended.code().name
        with self._lock:
            self.report.outcomes.setdefault("oversize", Counter())[status] += 1

    def _call(
        self, attacker: str, raw: bytes, client: str, read_at_most: int | None = None, pause_s: float = 0.0,
        timeout: float | None = None,
    ) -> str:  # fmt: skip
        """One Generate to its end (or until ``read_at_most`` messages, then cancelled); its status name."""
        metadata = (*self.metadata, (CLIENT_HEADER, client))
        call = self.generate(raw, timeout=timeout or self.config.call_timeout_s, metadata=metadata)
        with self._lock:
            self._calls.add(call)
        status = "OK"
        try:
            if read_at_most == 0:
                call.cancel()
            for count, _ in enumerate(call, start=1):
                if read_at_most is not None and count >= read_at_most:
                    call.cancel()
                    status = "CANCELLED"
                    break
                if pause_s:
                    time.sleep(pause_s)
        except grpc.RpcError as ended:
            status = ended.code().name
        finally:
            with self._lock:
                self._calls.discard(call)
                self.report.outcomes.setdefault(attacker, Counter())[status] += 1
        return status

    def _settle(self, read_gauges: Callable[[], Gauges]) -> None:
        """Wait for every page and session to come back; what does not is a leak."""
        started = time.monotonic()
        gauges = read_gauges()
        while gauges.held and time.monotonic() - started < SETTLE_TIMEOUT_S:
            time.sleep(0.05)
            gauges = read_gauges()
        self.report.settle_seconds = time.monotonic() - started
        self.report.leaks = gauges.held


def mutated_request(rng: random.Random) -> bytes:
    """Out-of-range and degenerate fields (each must be refused or served, never crash a neighbour),
    or random byte flips of a valid request."""
    fields: list[dict] = [
        {"text": "x", "temperature": 2e-38},
        {"text": "x", "temperature": 1.0, "top_p": 1e-300},
        {"text": "x", "temperature": float("nan")},
        {"text": "x", "temperature": float("inf")},
        {"text": "x", "max_new_tokens": -1},
        {"text": "x", "max_new_tokens": 2**31 - 1},
        {"token_ids": gateway_pb2.TokenIds(ids=[2**40, -5])},
        {"token_ids": gateway_pb2.TokenIds(ids=[])},
        {"text": ""},
        {"text": "x", "policy": "no-such-policy"},
        {"text": "x", "policy": "full", "tree_config": "9999:2:99"},
        {"text": "x", "stop": ["s" * 10_000]},
        {"text": "\x00" * 1000},
    ]
    if rng.random() < 0.5:
        return gateway_pb2.GenerateRequest(**rng.choice(fields)).SerializeToString()
    raw = bytearray(gateway_pb2.GenerateRequest(text="def f(x):", max_new_tokens=8, temperature=0.7).SerializeToString())
    for _ in range(rng.randint(1, 4)):
        raw[rng.randrange(len(raw))] = rng.randrange(256)
    return bytes(raw)


# -- gauges from Prometheus ----------------------------------------------------------------------


def scrape(address: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as page:
        lines = page.read().decode().splitlines()
    samples = (line.rsplit(" ", 1) for line in lines if line[:1] not in ("", "#"))
    return {name: float(value) for name, value in samples}


def scraped_gauges(addresses: list[str]) -> Callable[[], Gauges]:
    """Gauges summed over the metrics ports of every process (one for ``serve all``, three split)."""

    def read() -> Gauges:
        samples: Counter[str] = Counter()
        for address in addresses:
            samples.update(scrape(address))
        return Gauges(
            free_pages=int(samples['diffspec_kv_pages{state="free"}']),
            total_pages=int(samples['diffspec_kv_pages{state="total"}']),
            target_sessions=int(samples['diffspec_sessions{service="target"}']),
            draft_sessions=int(samples['diffspec_sessions{service="draft"}']),
            active_generations=int(samples["diffspec_active_generations"]),
        )

    return read


@dataclass(frozen=True)
class Spawned:
    gateway: str  # host:port of the gRPC gateway
    metrics: list[str]  # host:port of each process's Prometheus page
    pids: dict[str, int]  # role -> its server process


@contextmanager
def spawned(deployment: str, log_dir: Path, extra_flags: tuple[str, ...] = ()) -> Iterator[Spawned]:
    """``diffspec serve all``, or target + draft + gateway, each with ``extra_flags`` too."""
    from bench.processes import ServerProcess, free_port

    with ExitStack() as stack:

        def start(role: str, *flags: str) -> ServerProcess:
            flags = (*SPAWN_FLAGS, *extra_flags, *flags)
            server = ServerProcess(role, log_dir / f"{role}.log", list(flags), {}, free_port())
            stack.callback(server.stop)
            return server

        if deployment == "all":
            servers = [start("all")]
        else:
            target, draft = start("target"), start("draft")
            servers = [target, draft, start("gateway", "--target", target.address, "--draft", draft.address)]
        for server in servers:
            server.wait_serving(600)
        metrics = [f"127.0.0.1:{s.metrics_port}" for s in servers]
        yield Spawned(servers[-1].address, metrics, {s.role: s.process.pid for s in servers})


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.adversarial", description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--gateway", help="host:port of a running gateway (with --metrics)")
    where.add_argument("--spawn", choices=["all", "split"], help="start diffspec serve all, or three processes")
    parser.add_argument("--metrics", action="append", default=[], help="host:port of a process's Prometheus port")
    parser.add_argument("--seconds", type=float, default=AttackConfig.seconds)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tls-ca", default="", help="PEM CA bundle the channel trusts (empty = plaintext)")
    parser.add_argument("--out", type=Path, help="JSON report (default: stdout only)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.gateway and not args.metrics:
        raise SystemExit("--gateway needs --metrics: the leak check reads every process's gauges")
    settings = DiffSpecSettings(tls_ca=args.tls_ca)  # the token comes from DIFFSPEC_AUTH_TOKEN
    config = AttackConfig(seconds=args.seconds, seed=args.seed)
    with ExitStack() as stack:
        if args.spawn:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="adversarial-")))
            deployment = stack.enter_context(spawned(args.spawn, log_dir))
            gateway, metrics = deployment.gateway, deployment.metrics
        else:
            gateway, metrics = args.gateway, args.metrics
        channel = stack.enter_context(open_blocking_channel(gateway, settings))
        report = Attack(channel, call_metadata(settings), config).run(scraped_gauges(metrics))
    text = json.dumps(report.to_dict(), indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 1 if report.findings else 0


if __name__ == "__main__":
    sys.exit(main())
