"""The Ray Serve ingress deployment: the FastAPI app of ``router/app.py`` on a replica.

The replica builds its backend at start (``cluster.backend.ClusterBackend``: the
named global scheduler actor, the decode workers' handles, the model's tokenizer) and
then the app over it (``__serve_build_asgi_app__``), so the HTTP layer itself never
imports Ray.

With direct ingress (``router.direct_ingress``) the replica serves the router's port
itself, and Ray Serve binds that port without SO_REUSEADDR. When a replica dies with
clients connected, its connections linger in TCP TIME_WAIT for 60 s, and every
replacement fails to bind the port until then (measured: 65 to 70 s without an
endpoint). :func:`_reuse_port_for_direct_ingress` has the replica's server set the
socket options Serve already has for this (SO_REUSEADDR, and SO_REUSEPORT with it),
so a replacement serves the same port as soon as it has started (about 10 s).
"""

from __future__ import annotations

import asyncio
from typing import Any

from ray import serve

from router.app import RouterSettings, build_app
from router.tenants import TenantDirectory, TenantEntry


def _reuse_port_for_direct_ingress() -> None:
    """Make this replica's direct-ingress HTTP server bind with SO_REUSEADDR (see the
    module docstring). A Ray whose replica module differs keeps its own behaviour."""
    try:
        from ray.serve._private import replica
    except ImportError:
        return
    start = getattr(replica, "start_asgi_http_server", None)
    if start is None or getattr(start, "_tierserve_reuse", False):
        return

    async def start_reusing(*args: Any, **kwargs: Any) -> Any:
        kwargs["enable_so_reuseport"] = True
        return await start(*args, **kwargs)

    start_reusing._tierserve_reuse = True  # type: ignore[attr-defined]
    replica.start_asgi_http_server = start_reusing


@serve.ingress()
class RouterIngress:
    async def __init__(self, cfg: dict[str, Any], scheduler_name: str, namespace: str,
                       decode_ids: list[str], model_name: str, max_model_len: int,
                       tokenizer_path: str, model_aliases: list[str] | None = None) -> None:
        import ray

        from cluster.backend import ClusterBackend, HFTokenizer
        from cluster.config import ClusterConfig

        _reuse_port_for_direct_ingress()  # before Serve starts this replica's server
        self._cfg = ClusterConfig.from_dict(cfg)
        rc = self._cfg.router
        sched = await asyncio.to_thread(ray.get_actor, scheduler_name, namespace=namespace)
        handles = {}
        for wid in decode_ids:
            handles[wid] = await asyncio.to_thread(ray.get_actor, wid, namespace=namespace)
        if tokenizer_path == "stub":  # engine/stub.py: byte-level ids, no checkpoint
            from engine.testing import make_byte_tokenizer

            tokenizer = HFTokenizer(make_byte_tokenizer())
        else:
            tokenizer = await asyncio.to_thread(HFTokenizer.from_path, tokenizer_path)
        self._backend = ClusterBackend(sched, handles, tokenizer, model_name, max_model_len,
                                       rc.rpc_timeout_s, rc.request_timeout_s,
                                       rc.retry_resume_timeout_s, model_root=tokenizer_path,
                                       model_aliases=tuple(model_aliases or ()))

    def __serve_build_asgi_app__(self) -> Any:
        rc = self._cfg.router
        tenants = TenantDirectory(
            [TenantEntry(t.name, t.api_keys, t.tier, t.may_override_tier, t.max_tier_override)
             for t in self._cfg.tenants],
            self._cfg.tier_config.num_tiers)
        settings = RouterSettings(max_tokens_limit=rc.max_tokens_limit,
                                  default_max_tokens=rc.default_max_tokens,
                                  max_sequences_per_request=rc.max_sequences_per_request,
                                  request_timeout_s=rc.request_timeout_s,
                                  max_body_bytes=rc.max_body_bytes,
                                  open_metrics=rc.open_metrics)
        return build_app(self._backend, tenants=tenants, settings=settings)


def router_deployment(num_cpus: float = 0.25) -> Any:
    return serve.deployment(RouterIngress, name="tierserve-router",
                            ray_actor_options={"num_cpus": num_cpus},
                            max_ongoing_requests=1000)
