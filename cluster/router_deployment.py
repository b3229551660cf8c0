"""The Ray Serve ingress deployment: the FastAPI app of ``router/app.py`` on a replica.

The replica builds its backend at start (``cluster.backend.ClusterBackend``: the
named global scheduler actor, the decode workers' handles, the model's tokenizer) and
then the app over it (``__serve_build_asgi_app__``), so the HTTP layer itself never
imports Ray.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ray import serve

from router.app import RouterSettings, build_app
from router.tenants import TenantDirectory, TenantEntry


@serve.ingress()
class RouterIngress:
    async def __init__(self, cfg: dict[str, Any], scheduler_name: str, namespace: str,
                       decode_ids: list[str], model_name: str, max_model_len: int,
                       tokenizer_path: str) -> None:
        import ray

        from cluster.backend import ClusterBackend, HFTokenizer
        from cluster.config import ClusterConfig

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
                                       rc.rpc_timeout_s, rc.request_timeout_s)

    def __serve_build_asgi_app__(self) -> Any:
        rc = self._cfg.router
        tenants = TenantDirectory(
            [TenantEntry(t.name, t.api_keys, t.tier, t.may_override_tier, t.max_tier_override)
             for t in self._cfg.tenants],
            self._cfg.tier_config.num_tiers)
        settings = RouterSettings(max_tokens_limit=rc.max_tokens_limit,
                                  default_max_tokens=rc.default_max_tokens,
                                  request_timeout_s=rc.request_timeout_s,
                                  max_body_bytes=rc.max_body_bytes,
                                  open_metrics=rc.open_metrics)
        return build_app(self._backend, tenants=tenants, settings=settings)


def router_deployment(num_cpus: float = 0.25) -> Any:
    return serve.deployment(RouterIngress, name="tierserve-router",
                            ray_actor_options={"num_cpus": num_cpus},
                            max_ongoing_requests=1000)
