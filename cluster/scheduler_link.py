"""A worker's line to the global scheduler: its reports, and its registration.

A worker registers itself (``WorkerHello``) as soon as it has set up, on its first start
and after every restart of its process, and again whenever the scheduler answers a report
with "unknown" (the scheduler restarted and lost its view, or it gave this process up).
The hello carries what the worker holds, so a restarted scheduler can adopt it; the
answer names the requests the cluster already ended, which the worker drops.

While the scheduler is unreachable (restarting) reports do not get there, with one warning
per outage instead of a traceback per report: ``report`` answers False and the worker keeps
their events for the next one, and goes on serving what it has (its tokens go to the routers
directly). Every call is awaited with a timeout.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from scheduler.messages import HelloAnswer, WorkerHello, WorkerReport, decode, encode

log = logging.getLogger(__name__)

RPC_TIMEOUT_S = 10.0
REGISTER_RETRY_S = 1.0

HelloFn = Callable[[], WorkerHello]
DropFn = Callable[[tuple[str, ...]], Awaitable[None]]


class SchedulerLink:
    def __init__(self, scheduler_name: str, namespace: str, worker_id: str, incarnation: str,
                 self_handle: Any = None) -> None:
        self.scheduler_name = scheduler_name
        self.namespace = namespace
        self.worker_id = worker_id
        self.incarnation = incarnation
        self._self_handle = self_handle
        self._handle: Any = None
        self._hello: HelloFn | None = None
        self._drop: DropFn | None = None
        self._registering: asyncio.Task[None] | None = None
        self.is_registered = False
        self._is_down = False

    def bind(self, hello: HelloFn, drop: DropFn) -> None:
        """What to say when registering, and how to drop what the scheduler ended."""
        self._hello, self._drop = hello, drop

    async def _scheduler(self) -> Any:
        if self._handle is None:
            import ray

            self._handle = await asyncio.to_thread(ray.get_actor, self.scheduler_name,
                                                   namespace=self.namespace)
        return self._handle

    def _down(self, what: str, e: BaseException) -> None:
        if not self._is_down:
            log.warning("%s: the global scheduler is unreachable (%s: %s); %s", self.worker_id,
                        what, type(e).__name__, "retrying")
        self._is_down = True

    def _up(self) -> None:
        if self._is_down:
            log.info("%s: the global scheduler answers again", self.worker_id)
        self._is_down = False

    async def report(self, rep: WorkerReport) -> bool:
        """Send a report; an "unknown" answer starts a registration. False: the scheduler
        did not take it (unreachable, or it does not know this worker yet), so the worker
        keeps its events for the next report."""
        try:
            h = await self._scheduler()
            known = await asyncio.wait_for(
                h.report.remote(encode(replace(rep, incarnation=self.incarnation))),
                RPC_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # restarting, or not created yet: the next report retries
            self._down("report", e)
            return False
        self._up()
        if known is False and self.is_registered:
            self.is_registered = False
            self.register_soon()
        return known is not False

    def register_soon(self) -> None:
        if self._registering is None or self._registering.done():
            self._registering = asyncio.get_running_loop().create_task(self.register())

    async def register(self) -> None:
        """Register (again), retrying until the scheduler answers."""
        assert self._hello is not None and self._drop is not None, "bind() first"
        while True:
            try:
                h = await self._scheduler()
                raw = await asyncio.wait_for(
                    h.register_worker.remote(encode(self._hello()), self._self_handle),
                    RPC_TIMEOUT_S)
                answer = decode(raw, HelloAnswer)
                break
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._down("register", e)
                await asyncio.sleep(REGISTER_RETRY_S)
        self._up()
        self.is_registered = True
        if answer.drop_req_ids:
            log.info("%s: dropping %d requests the cluster already ended", self.worker_id,
                     len(answer.drop_req_ids))
            await self._drop(answer.drop_req_ids)
