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

Keys: the replica gets the tree with key digests and key file paths only
(``cluster/config.py``); it reads the key files itself at start (a bad one stops it
with the file named) and re-reads them every ``router.key_reload_interval_s``
(``router/key_files.py``), so a rotated Secret takes effect without a restart. Where a
node carries the custom resource ``tierserve_router`` (the Helm chart's head, the only
pod with the key Secret mounted), the replica is placed there.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from ray import serve

from cluster.topology import role_resource
from router.app import RouterSettings, build_app
from router.key_digests import KeyDigest
from router.key_files import KeyFileWatcher
from router.tenants import TenantDirectory, TenantEntry

if TYPE_CHECKING:
    from cluster.config import ClusterConfig

ROUTER_RESOURCE = role_resource("router")
PIN_AMOUNT = 0.001  # a marker, never the limit


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
        if self._cfg.keys_withheld:
            raise ValueError("the router needs the configuration with its tenants' keys, "
                             "got the scheduler's and workers' copy (keys_withheld)")
        self._tenants = tenant_directory(self._cfg)
        self._key_watch: asyncio.Task[None] | None = None
        if self._tenants.key_files:
            watcher = KeyFileWatcher(self._tenants)
            await asyncio.to_thread(watcher.load)  # a bad file: this replica does not start
            self._key_watch = asyncio.get_running_loop().create_task(
                watcher.run(self._cfg.router.key_reload_interval_s))
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
        settings = RouterSettings(max_tokens_limit=rc.max_tokens_limit,
                                  default_max_tokens=rc.default_max_tokens,
                                  max_sequences_per_request=rc.max_sequences_per_request,
                                  request_timeout_s=rc.request_timeout_s,
                                  max_body_bytes=rc.max_body_bytes,
                                  open_metrics=rc.open_metrics)
        return build_app(self._backend, tenants=self._tenants, settings=settings)


def tenant_directory(cfg: ClusterConfig) -> TenantDirectory:
    """The router's tenants from ``cfg`` (a ClusterConfig): digests and key file paths."""
    return TenantDirectory(
        [TenantEntry(t.name, tuple(KeyDigest.parse(d) for d in t.api_key_digests), t.tier,
                     t.may_override_tier, t.max_tier_override, key_file=t.api_keys_file)
         for t in cfg.tenants],
        cfg.tier_config.num_tiers)


def router_deployment(num_cpus: float = 0.25) -> Any:
    import ray

    options: dict[str, Any] = {"num_cpus": num_cpus}
    if ray.is_initialized() and ROUTER_RESOURCE in ray.cluster_resources():
        options["resources"] = {ROUTER_RESOURCE: PIN_AMOUNT}
    return serve.deployment(RouterIngress, name="tierserve-router",
                            ray_actor_options=options, max_ongoing_requests=1000)
