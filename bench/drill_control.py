"""The drill's hands on the cluster, through Ray (``bench/drill.py``): the scheduler's
view, a worker's status, killing an actor (Ray restarts it) or a Serve router replica
(Serve replaces it), and telling a new start of a part from the one the drill hit.
"""

from __future__ import annotations

import asyncio
import enum
from typing import Any


class Fault(enum.Enum):
    DECODE = "decode"  # kill the decode worker that holds the most streams
    PREFILL = "prefill"  # kill a prefill worker while it computes prompts
    SCHEDULER = "scheduler"  # kill the global scheduler
    ROUTER = "router"  # kill a router (Serve) replica
    DECODE_HANG = "decode-hang"  # SIGSTOP the busiest decode worker's process (this host)


class ClusterControl:
    """Ray calls for the drill (the caller has joined the cluster)."""

    def __init__(self, namespace: str = "tierserve", scheduler_name: str = "tierserve-scheduler",
                 app_name: str = "tierserve", router_deployment: str = "tierserve-router") -> None:
        self.namespace = namespace
        self.scheduler_name = scheduler_name
        self.app_name = app_name
        self.router_deployment = router_deployment

    def _actor(self, name: str, namespace: str | None = None) -> Any:
        import ray

        return ray.get_actor(name, namespace=namespace or self.namespace)

    async def incarnation(self, fault: Fault, target: str) -> str:
        """Which start of the target's process runs now ("" when it does not answer)."""
        try:
            if fault is Fault.SCHEDULER:
                return str((await self.stats()).get("incarnation", ""))
            if fault is Fault.ROUTER:
                return target if target in await self.router_replicas() else ""
            return str((await self.worker_status(target)).get("incarnation", ""))
        except Exception:  # restarting
            return ""

    async def is_back(self, fault: Fault, target: str, before: str) -> bool:
        """A new start of the target runs and serves (registered and alive)."""
        try:
            if fault is Fault.ROUTER:
                replicas = await self.router_replicas()
                return bool(replicas) and target not in replicas
            stats = await self.stats()
            if fault is Fault.SCHEDULER:
                return bool(stats.get("ready")) and stats.get("incarnation") not in ("", before)
            status = await self.worker_status(target)
            alive = bool(stats["workers"].get(target, {}).get("alive"))
            return alive and bool(status.get("ready")) and status.get("incarnation") != before
        except Exception:  # restarting
            return False

    async def stats(self) -> dict[str, Any]:
        from cluster.messages import unpack

        h = await asyncio.to_thread(self._actor, self.scheduler_name)
        return unpack(await asyncio.wait_for(h.stats.remote(), 10))

    async def worker_status(self, worker_id: str) -> dict[str, Any]:
        from cluster.messages import unpack

        h = await asyncio.to_thread(self._actor, worker_id)
        return unpack(await asyncio.wait_for(h.status.remote(), 10))

    async def kill(self, name: str, *, restart: bool = True, namespace: str | None = None) -> None:
        import ray

        h = await asyncio.to_thread(self._actor, name, namespace)
        await asyncio.to_thread(ray.kill, h, no_restart=not restart)

    async def router_replicas(self) -> list[str]:
        import ray

        prefix = f"SERVE_REPLICA::{self.app_name}#{self.router_deployment}#"
        named = await asyncio.to_thread(ray.util.list_named_actors, all_namespaces=True)
        return sorted(a["name"] for a in named
                      if a["namespace"] == "serve" and a["name"].startswith(prefix))

    async def is_local(self, worker_id: str) -> bool:
        """The worker runs on this machine (a hang drill signals its process)."""
        import ray

        status = await self.worker_status(worker_id)
        infos = await self._infos()
        node = infos.get(worker_id, {}).get("ray_node_id")
        return bool(status.get("pid")) and node == ray.get_runtime_context().get_node_id()

    async def _infos(self) -> dict[str, dict[str, Any]]:
        from cluster.messages import unpack

        h = await asyncio.to_thread(self._actor, self.scheduler_name)
        return {i["worker_id"]: i for i in unpack(await asyncio.wait_for(
            h.worker_infos.remote(), 10))}
