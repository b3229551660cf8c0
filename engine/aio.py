"""Small asyncio helpers shared by the actors' loops (no torch: the scheduler's actor uses them)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until ``event`` is set or ``timeout_s`` passes; True when it was set.

    Built on ``asyncio.wait`` rather than ``wait_for``: on Python 3.10/3.11 ``wait_for``
    can swallow a cancellation that races its timeout, and a loop built on it may then
    never stop.
    """
    waiter = asyncio.ensure_future(event.wait())
    try:
        done, _ = await asyncio.wait({waiter}, timeout=timeout_s)
    finally:
        waiter.cancel()
    return bool(done)


class Reporter:
    """A worker's reports to the global scheduler, one in flight at a time: ``build``
    makes the report of now, ``send`` delivers it (False or raising: it did not get
    there), ``delivered(report, ok)`` tells the worker which of its events may go."""

    def __init__(self, name: str, build: Callable[[], Any],
                 send: Callable[[Any], Awaitable[bool | None]],
                 delivered: Callable[[Any, bool], None]) -> None:
        self.name, self._build, self._send, self._delivered = name, build, send, delivered
        self._task: asyncio.Task[None] | None = None

    @property
    def busy(self) -> bool:
        return self._task is not None and not self._task.done()

    def soon(self) -> None:
        if not self.busy:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        rep = self._build()
        try:
            ok = await self._send(rep) is not False
        except asyncio.CancelledError:
            raise
        except Exception:  # the scheduler may be restarting: report next time
            log.exception("%s: report failed", self.name)
            ok = False
        self._delivered(rep, ok)


async def step_loop(name: str, wake: asyncio.Event, turn: Callable[[], Awaitable[None]],
                    idle_s: Callable[[], float | None],
                    give_up: Callable[[int], Awaitable[None]], *, max_failures: int) -> None:
    """A worker's step loop: each turn waits for ``wake`` (at most ``idle_s()`` seconds;
    None: no wait, there is work), then runs ``turn``. A turn that raises is logged and
    retried; ``max_failures`` in a row call ``give_up(n)`` (end the failing step's
    requests), a bound, never a retry forever."""
    failures = 0
    while True:
        timeout = idle_s()
        if timeout is not None:
            await wait_event(wake, timeout)
        wake.clear()
        try:
            await turn()
            failures = 0
        except asyncio.CancelledError:
            raise
        except Exception:  # keep serving the other requests
            failures += 1
            log.exception("%s: step failed (%d in a row)", name, failures)
            if failures >= max_failures:
                failures = 0
                await give_up(max_failures)
            await asyncio.sleep(0.05)


class Streams:
    """One byte stream per reader (a router's token subscription): ``subscribe`` yields
    what ``put`` queues for that reader; a re-subscription ends the older stream.
    ``on_join``/``on_leave`` tell the owner who is reading."""

    def __init__(self, on_join: Callable[[str], None], on_leave: Callable[[str], None]) -> None:
        self._queues: dict[str, asyncio.Queue[bytes]] = {}
        self._on_join, self._on_leave = on_join, on_leave

    def put(self, name: str, item: bytes) -> None:
        self._queues[name].put_nowait(item)

    async def subscribe(self, name: str, on_open: Callable[[], None]) -> AsyncIterator[bytes]:
        q: asyncio.Queue[bytes] = asyncio.Queue()
        old = self._queues.get(name)
        self._queues[name] = q
        self._on_join(name)
        if old is not None:
            old.put_nowait(b"")  # the newer stream replaces it: end it
        on_open()
        try:
            while item := await q.get():
                yield item
        finally:
            if self._queues.get(name) is q:
                del self._queues[name]
                self._on_leave(name)
