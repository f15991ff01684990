"""A model warms up before its service turns ready, and says what it did in one log line."""

from __future__ import annotations

import asyncio
import logging
import threading

from cli.services import warm_up


class CountingRuntime:
    def __init__(self) -> None:
        self.threads: list[str] = []

    def warm_up(self) -> int:
        self.threads.append(threading.current_thread().name)
        return 35


def test_warm_up_runs_off_the_event_loop_and_logs_its_count(caplog):
    runtime = CountingRuntime()
    with caplog.at_level(logging.INFO, logger="diffspec.serve"):
        asyncio.run(warm_up(runtime, "the target's step graphs recorded"))
    assert len(runtime.threads) == 1 and runtime.threads[0] != threading.main_thread().name
    assert [r.getMessage().split(" in ")[0] for r in caplog.records] == ["warm-up: 35 of the target's step graphs recorded"]
