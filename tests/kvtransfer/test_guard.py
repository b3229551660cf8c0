"""Threads of the KV plane stay up (issue 24 item 2): a supervised thread that ends is
started again, one that keeps ending makes its endpoint unhealthy, and the transfer
watchdog survives a handler that raises."""

from __future__ import annotations

import threading

from cluster.testing import wait_until
from kvtransfer import TransferConfig
from kvtransfer.guard import SupervisedThread
from kvtransfer.state import Side
from kvtransfer.transfers import TransferRecord, TransferTable, Watchdog


class Flaky:
    """A thread body that fails its first ``failures`` runs, then serves until stopped."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.runs = 0
        self.serving = threading.Event()
        self.stop = threading.Event()

    def __call__(self) -> None:
        self.runs += 1
        if self.runs <= self.failures:
            raise RuntimeError(f"run {self.runs} fails")
        self.serving.set()
        self.stop.wait()


def test_a_thread_that_fails_is_restarted() -> None:
    body = Flaky(failures=2)
    thread = SupervisedThread("t", body, lambda: not body.stop.is_set(), max_restarts=5)
    thread.start()
    try:
        assert body.serving.wait(10)
        assert thread.num_restarts == 2 and thread.is_healthy and thread.is_alive
    finally:
        body.stop.set()
        thread.join(5)
    assert not thread.is_alive and thread.num_restarts == 2  # stopped: not restarted


def test_a_thread_that_keeps_failing_turns_unhealthy() -> None:
    body = Flaky(failures=1_000)
    thread = SupervisedThread("t", body, lambda: True, max_restarts=3, window_s=600)
    thread.start()
    thread.join(10)
    assert not thread.is_alive and not thread.is_healthy
    assert body.runs == 4 and thread.num_restarts == 3
    thread.check()  # gave up: check() does not start it again
    assert not thread.is_alive


def test_check_restarts_a_thread_that_is_gone() -> None:
    body = Flaky(failures=0)
    running = threading.Event()
    running.set()
    thread = SupervisedThread("t", body, running.is_set, max_restarts=5)
    thread.start()
    assert body.serving.wait(10)
    running.clear()  # the owner pauses it: the body returns, nothing restarts it
    body.stop.set()
    thread.join(5)
    assert not thread.is_alive
    running.set()
    body.stop.clear()
    body.serving.clear()
    thread.check()
    try:
        assert body.serving.wait(10) and thread.num_restarts == 1
    finally:
        body.stop.set()
        running.clear()
        thread.join(5)


def test_the_watchdog_survives_a_handler_that_raises() -> None:
    table = TransferTable(Side.CONSUMER)
    table.add(TransferRecord("r", Side.CONSUMER, [1], frozenset(), 1, created=0.0))
    calls: list[str] = []

    def on_overdue(record: TransferRecord) -> None:
        calls.append(record.req_id)
        if len(calls) == 1:
            raise RuntimeError("a bug in one round")

    watchdog = Watchdog(table, TransferConfig(start_timeout_s=0.05, stall_timeout_s=0.05),
                        on_overdue)
    try:
        assert wait_until(lambda: len(calls) >= 2, 10, 0.02)
    finally:
        watchdog.stop()
