"""Soak a gateway: ``bench.adversarial``'s mixed valid and invalid clients for ``--seconds``, with the
servers' memory and gauges sampled all along.

Valid requests (the innocent client's short generations, a flood of long ones, streams cancelled
at every phase, slow readers) and invalid ones (mutated messages, out-of-range fields, texts past
the context's bound, long ``Tokenize`` calls) come from threads of their own. Every
``--sample-every`` seconds the resident memory (RSS) of each server process and the KV pool, session
and generation gauges are recorded. Reported (JSON, plus a plot of the timeline): requests by
attacker and status, the innocent client's latency alone and under attack, RSS at the attack's
start, middle and end, and what is still held once the attack stops (``leaks``: must be empty, the
pool full and no session open). Exit status 1 with findings.

    python -m bench.soak --spawn all --seconds 600 --out bench/results/soak.json --plot bench/results/soak.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from bench.adversarial import Attack, AttackConfig, Gauges, scraped_gauges, spawned
from diffspec.grpc_options import call_metadata, open_blocking_channel
from diffspec.settings import DiffSpecSettings

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Sample:
    t_s: float  # since the soak started
    rss_mb: dict[str, float]  # role -> its server process's
    free_pages: int
    total_pages: int
    target_sessions: int
    draft_sessions: int
    active_generations: int


def rss_mb(pid: int) -> float:
    """Resident memory of a process (Linux /proc), in MiB."""
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * PAGE_BYTES / 2**20


class Sampler:
    """Records a ``Sample`` every ``every_s`` seconds on a thread of its own, until ``stop``."""

    def __init__(self, pids: dict[str, int], read_gauges: Callable[[], Gauges], every_s: float) -> None:
        self.pids = pids
        self.read_gauges = read_gauges
        self.every_s = every_s
        self.samples: list[Sample] = []
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()  # the state after the attack settled

    def sample(self) -> None:
        gauges = self.read_gauges()
        self.samples.append(
            Sample(
                round(time.monotonic() - self._started, 2),
                {role: round(rss_mb(pid), 1) for role, pid in self.pids.items()},
                gauges.free_pages,
                gauges.total_pages,
                gauges.target_sessions,
                gauges.draft_sessions,
                gauges.active_generations,
            )
        )

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()


def soak(
    channel: grpc.Channel,
    metadata: tuple[tuple[str, str], ...],
    config: AttackConfig,
    read_gauges: Callable[[], Gauges],
    pids: dict[str, int],
    sample_every_s: float,
) -> dict:
    """Run the attack with the sampler beside it; the report with its timeline and memory summary."""
    sampler = Sampler(pids, read_gauges, sample_every_s)
    sampler.start()
    report = Attack(channel, metadata, config).run(read_gauges)
    sampler.stop()
    totals = [round(sum(s.rss_mb.values()), 1) for s in sampler.samples]
    start, middle, end = totals[0], totals[len(totals) // 2], totals[-1]
    last = sampler.samples[-1]
    summary = report.to_dict()
    summary.update(
        seconds=config.seconds,
        requests=sum(sum(calls.values()) for calls in summary["outcomes"].values()),
        rss_mb={"start": start, "middle": middle, "end": end, "max": max(totals),
                "drift_second_half": round(end - middle, 1)},  # fmt: skip
        pool_full_at_end=last.free_pages == last.total_pages,
        sessions_at_end={"target": last.target_sessions, "draft": last.draft_sessions},
        timeline=[asdict(s) for s in sampler.samples],
    )
    return summary


def plot(summary: dict, path: Path) -> None:
    """RSS, free KV pages and open sessions over the soak, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timeline = summary["timeline"]
    t = [s["t_s"] for s in timeline]
    figure, (rss, pages, sessions) = plt.subplots(3, 1, sharex=True, figsize=(8, 7))
    for role in timeline[0]["rss_mb"]:
        rss.plot(t, [s["rss_mb"][role] for s in timeline], label=role)
    rss.set_ylabel("RSS (MiB)")
    rss.legend(loc="lower right")
    pages.plot(t, [s["free_pages"] for s in timeline], label="free")
    pages.plot(t, [s["total_pages"] for s in timeline], "--", label="total")
    pages.set_ylabel("KV pages")
    pages.legend(loc="lower right")
    for gauge in ("target_sessions", "draft_sessions", "active_generations"):
        sessions.plot(t, [s[gauge] for s in timeline], label=gauge)
    sessions.set_ylabel("open")
    sessions.set_xlabel("seconds")
    sessions.legend(loc="upper right")
    figure.suptitle(f"soak: {summary['seconds']:.0f} s, {summary['requests']} requests")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--spawn", choices=["all", "split"], default="all", help="the deployment to start")
    parser.add_argument("--seconds", type=float, default=60.0, help="length of the attack")
    parser.add_argument("--sample-every", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("--baseline", type=int, default=10, help="innocent requests before the attack")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="JSON report (default: stdout only)")
    parser.add_argument("--plot", type=Path, help="PNG of RSS, pages and sessions over time")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    config = AttackConfig(seconds=args.seconds, seed=args.seed, innocent_baseline=args.baseline)
    settings = DiffSpecSettings()  # a token comes from DIFFSPEC_AUTH_TOKEN
    with ExitStack() as stack:
        log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="soak-")))
        deployment = stack.enter_context(spawned(args.spawn, log_dir))
        channel = stack.enter_context(open_blocking_channel(deployment.gateway, settings))
        read_gauges = scraped_gauges(deployment.metrics)
        summary = soak(channel, call_metadata(settings), config, read_gauges, deployment.pids, args.sample_every)
    text = json.dumps(summary, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k != "timeline"}, indent=2))
    if args.out:
        args.out.write_text(text + "\n")
    if args.plot:
        plot(summary, args.plot)
    return 1 if summary["findings"] or not summary["pool_full_at_end"] else 0


if __name__ == "__main__":
    sys.exit(main())
