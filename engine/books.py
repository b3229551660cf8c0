"""The lock over an engine's books (its block pool and request table).

An engine is driven from one thread (``engine.service.EngineThread``), which holds
:class:`BooksLock` for every call it runs; a step lets it go while the model runs
(``LLMEngine._forward_and_sample`` reads only the block tables of the requests it runs and
changes no book). Another thread may then change the books under the lock: a decode
worker reserves blocks for an arriving request from its event loop, so a dispatch no
longer waits for the decode step in flight (issue 22 item 6, issue 23 item 2).

Reentrant for its owner; :meth:`released` lets it go whatever the depth, and is a no-op
on a thread that does not hold it (an engine driven without an ``EngineThread``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class BooksLock:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._depth = 0

    def __enter__(self) -> BooksLock:
        me = threading.get_ident()
        if self._owner == me:
            self._depth += 1
            return self
        self._lock.acquire()
        self._owner, self._depth = me, 1
        return self

    def __exit__(self, *exc: object) -> None:
        if self._owner != threading.get_ident():
            raise RuntimeError("BooksLock released by a thread that does not hold it")
        self._depth -= 1
        if self._depth == 0:
            self._owner = None
            self._lock.release()

    @property
    def is_held(self) -> bool:
        """Held by the calling thread."""
        return self._owner == threading.get_ident()

    @contextmanager
    def released(self) -> Iterator[None]:
        """Let the lock go for the block (the owner's whole depth), then take it back."""
        if self._owner != threading.get_ident():
            yield
            return
        depth = self._depth
        self._owner, self._depth = None, 0
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()
            self._owner, self._depth = threading.get_ident(), depth
