"""What the KV plane refuses, how it counts it, and who keeps its threads alive.

Everything an endpoint reads from its rendezvous store or a peer is untrusted until
checked (``kvtransfer.auth``, ``kvtransfer.wire``). A message that fails a check is a
:class:`Refusal`: dropped, counted on the connection it came from (a
:class:`RefusalCounts`, one per accept queue and per pair), and never acted on. No refusal
ends a thread.

A thread that ends anyway (a bug, a lost connection to the store) is restarted by its
:class:`SupervisedThread`; one that keeps ending marks its endpoint unhealthy, which the
worker's report carries to the scheduler, whose watch replaces the worker
(``cluster/supervisor.py``).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


class Refusal(enum.Enum):
    """Why a message was dropped."""

    MALFORMED = "malformed"  # sealed right, but does not decode (a peer's bug)
    FORGED = "forged"  # not sealed by a holder of the secret: random bytes, truncated,
    # a wrong proof, a value overwritten or moved to another key
    REPLAYED = "replayed"  # a sealed message, or a Hello's pair, seen before
    OVERSIZE = "oversize"  # longer than the stream's bound (checked before anything else)
    OVER_BOUND = "over_bound"  # the accept queue held more Hellos than its bound
    UNEXPECTED = "unexpected"  # a well-formed message of a kind this stream does not carry


class RefusalCounts:
    """Refusals on one connection, by kind; safe to bump from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(Refusal, 0)

    def count(self, refusal: Refusal, n: int = 1) -> int:
        """Count ``n`` more; returns how many of this kind there are now."""
        with self._lock:
            self._counts[refusal] += n
            return self._counts[refusal]

    def add(self, other: RefusalCounts) -> None:
        for refusal, n in other.snapshot().items():
            self.count(refusal, n)

    def snapshot(self) -> dict[Refusal, int]:
        with self._lock:
            return dict(self._counts)

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())


def worth_logging(n: int) -> bool:
    """The 1st, 2nd, 4th, 8th... refusal of a kind: a flood logs a few lines, not one each."""
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True, slots=True)
class ListenerStats:
    """An endpoint's refusals and thread health, as a worker's status shows them."""

    accept: dict[Refusal, int]  # on the accept queue (Hellos)
    pairs: dict[Refusal, int]  # on every pair's streams, live and closed ones summed
    num_thread_restarts: int
    dead_threads: tuple[str, ...]  # supervised threads that ended for good
    is_healthy: bool

    @property
    def num_refused(self) -> int:
        return sum(self.accept.values()) + sum(self.pairs.values())


class SupervisedThread:
    """``target`` run in a daemon thread for as long as ``should_run()``: when it returns
    or raises before then, it is started again (after a short backoff). More than
    ``max_restarts`` restarts within ``window_s`` means it cannot work here: it stays down
    and ``is_healthy`` turns False. :meth:`check` also restarts a thread that died without
    running its own handler (called from the endpoint's watchdog)."""

    def __init__(self, name: str, target: Callable[[], None], should_run: Callable[[], bool],
                 *, max_restarts: int = 5, window_s: float = 60.0) -> None:
        self.name = name
        self._target, self._should_run = target, should_run
        self._max_restarts, self._window_s = max_restarts, window_s
        self._restarts: deque[float] = deque()
        self._lock = threading.Lock()
        self.num_restarts = 0
        self.is_healthy = True
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def check(self) -> None:
        """Restart the thread if it is gone while it should run (and may)."""
        with self._lock:
            if self._thread.is_alive() or not self.is_healthy or not self._should_run():
                return
            if not self._note_restart():
                return
            self._thread = threading.Thread(target=self._run, daemon=True, name=self.name)
            self._thread.start()

    def _note_restart(self) -> bool:
        """Count a restart; False (and unhealthy) when there were too many lately."""
        now = time.monotonic()
        while self._restarts and now - self._restarts[0] > self._window_s:
            self._restarts.popleft()
        if len(self._restarts) >= self._max_restarts:
            self.is_healthy = False
            log.error("kvtransfer: thread %s ended %d times within %.0f s; left down, the "
                      "endpoint reports itself unhealthy", self.name, len(self._restarts) + 1,
                      self._window_s)
            return False
        self._restarts.append(now)
        self.num_restarts += 1
        return True

    def _run(self) -> None:
        backoff = 0.05
        while self._should_run():
            try:
                self._target()
            except Exception:
                log.exception("kvtransfer: thread %s failed", self.name)
            if not self._should_run():
                return
            with self._lock:
                if not self._note_restart():
                    return
            log.warning("kvtransfer: restarting thread %s", self.name)
            time.sleep(backoff)
            backoff = min(1.0, backoff * 2)
