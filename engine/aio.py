"""Small asyncio helpers shared by the actors' loops (no torch: the scheduler's actor uses them)."""

from __future__ import annotations

import asyncio


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
