"""Building the cluster: plain builder functions, each binding one piece into the next.

Data flow (Ray Serve LLM style)::

    ClusterConfig ──start_workers──▶ named global scheduler actor + prefill/decode worker
    actors (each sets itself up: model loaded, KV endpoint open, location found, then
    registers itself with the scheduler) ──build_router_app──▶ Serve application
    (FastAPI ingress bound to the scheduler and the decode workers) ──deploy──▶
    http://host:port

Every actor runs with ``max_restarts=-1``: Ray starts a crashed one again under the same
name, and it sets up and registers again by itself (``cluster/supervisor.py``).

``RunningCluster.shutdown()`` tears it down in reverse. Worker actors use fractional
CPUs on CPU machines (``pools.num_cpus_per_worker``) and GPUs where configured; with
``topology.pin_to_node_resource`` each worker is pinned to the Ray custom resource
``node_<name>`` of its declared node (how tests place workers on a multi-node cluster).
A worker with a declared NVLink domain also asks for ``tierserve_domain_<name>``, and
every worker for ``tierserve_<role>``, whenever some node carries that resource (the
Helm chart's worker nodes do), so it lands on a node of its domain and pool.
On KubeRay, ``cluster.serve_app:app_builder`` builds the same pieces as detached actors
(``launch_workers(detached=True)``) or reuses running ones (``attach_workers``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.config import ClusterConfig
from cluster.messages import scheduler_actor_name, unpack, worker_actor_name
from cluster.topology import domain_resource, role_resource
from cluster.worker_runtime import resolve_model_path

log = logging.getLogger(__name__)

SETUP_TIMEOUT_S = 600.0
SCHEDULER_NUM_CPUS = 0.1


@dataclass
class ClusterHandles:
    namespace: str
    scheduler_name: str
    scheduler: Any
    prefill: dict[str, Any] = field(default_factory=dict)
    decode: dict[str, Any] = field(default_factory=dict)
    infos: list[dict[str, Any]] = field(default_factory=list)

    @property
    def max_model_len(self) -> int:
        return min(int(i["max_model_len"]) for i in self.infos)

    def stats(self) -> dict[str, Any]:
        import ray

        return unpack(ray.get(self.scheduler.stats.remote(), timeout=30))


PIN_AMOUNT = 0.001  # of a placement resource: a marker, never the limit


def _worker_options(cfg: ClusterConfig, role: str, index: int, namespace: str,
                    cluster_resources: Collection[str] = (), *,
                    detached: bool = False) -> dict[str, Any]:
    """Ray options of one worker actor, with its placement resources.

    Placement: ``node_<name>`` of the declared node (``topology.pin_to_node_resource``);
    the declared domain's ``tierserve_domain_<name>`` and the role's ``tierserve_<role>``
    when some node of the cluster carries them (the Helm chart's worker nodes do).
    """
    opts: dict[str, Any] = {
        "name": worker_actor_name(role, index),
        "namespace": namespace,
        "num_cpus": cfg.pools.num_cpus_per_worker,
        "num_gpus": cfg.pools.num_gpus_per_worker,
        "max_concurrency": 1000,
        # Ray restarts a worker whose process died; it registers again by itself.
        "max_restarts": -1,
    }
    if detached:
        opts["lifetime"] = "detached"
    declared = cfg.topology.prefill if role == "prefill" else cfg.topology.decode
    entry = declared[index] if index < len(declared) else None
    resources: dict[str, float] = {}
    if cfg.topology.pin_to_node_resource and entry is not None:
        resources[f"node_{entry.node}"] = PIN_AMOUNT
    if entry is not None and domain_resource(entry.nvlink_domain) in cluster_resources:
        resources[domain_resource(entry.nvlink_domain)] = PIN_AMOUNT
    if role_resource(role) in cluster_resources:
        resources[role_resource(role)] = PIN_AMOUNT
    if resources:
        opts["resources"] = resources
    return opts


def launch_workers(cfg: ClusterConfig, *, suffix: str = "", namespace: str | None = None,
                   detached: bool = False) -> tuple[ClusterHandles, list[Any]]:
    """Create the scheduler and worker actors; their setup (model load) runs in the
    background: the returned refs resolve to each worker's info. ``detached`` actors
    outlive the driver that made them (the Serve application builder's case)."""
    import ray

    from cluster.scheduler_actor import scheduler_actor
    from cluster.worker_actors import decode_worker_actor, prefill_worker_actor

    namespace = namespace or ray.get_runtime_context().namespace
    life = {"lifetime": "detached"} if detached else {}
    have = set(ray.cluster_resources())
    sname = scheduler_actor_name(suffix)
    expected = [worker_actor_name("prefill", i) + suffix for i in range(cfg.pools.num_prefill)]
    expected += [worker_actor_name("decode", i) + suffix for i in range(cfg.pools.num_decode)]
    # Keys only where they are checked: the scheduler and the workers get none.
    cfg_dict = cfg.without_keys().to_dict()
    sched = scheduler_actor().options(name=sname, namespace=namespace,
                                      num_cpus=SCHEDULER_NUM_CPUS, max_restarts=-1,
                                      max_concurrency=1000, **life).remote(cfg_dict, expected)
    h = ClusterHandles(namespace, sname, sched)
    for i in range(cfg.pools.num_prefill):
        wid = worker_actor_name("prefill", i) + suffix
        opts = _worker_options(cfg, "prefill", i, namespace, have,
                               detached=detached) | {"name": wid}
        h.prefill[wid] = prefill_worker_actor().options(**opts).remote(
            wid, i, cfg_dict, sname, namespace)
    for i in range(cfg.pools.num_decode):
        wid = worker_actor_name("decode", i) + suffix
        opts = _worker_options(cfg, "decode", i, namespace, have,
                               detached=detached) | {"name": wid}
        h.decode[wid] = decode_worker_actor().options(**opts).remote(
            wid, i, cfg_dict, sname, namespace)
    return h, [a.setup.remote() for a in {**h.prefill, **h.decode}.values()]


def attach_workers(cfg: ClusterConfig, namespace: str, *, suffix: str = "") -> ClusterHandles | None:
    """Handles to a scheduler and workers already running under their names in
    ``namespace`` (registered), or None when there are none to reuse."""
    import ray

    sname = scheduler_actor_name(suffix)
    try:
        sched = ray.get_actor(sname, namespace=namespace)
    except ValueError:  # no actor by that name
        return None
    infos = unpack(ray.get(sched.worker_infos.remote(), timeout=60))
    if not infos:
        return None
    h = ClusterHandles(namespace, sname, sched, infos=infos)
    for info in infos:
        wid = str(info["worker_id"])
        pool = h.prefill if info["role"] == "prefill" else h.decode
        pool[wid] = ray.get_actor(wid, namespace=namespace)
    want = cfg.pools.num_prefill + cfg.pools.num_decode
    if len(h.prefill) + len(h.decode) != want:
        log.warning("running cluster has %d workers, config wants %d: reusing it as is",
                    len(h.prefill) + len(h.decode), want)
    return h


def await_workers(h: ClusterHandles, setup_refs: list[Any]) -> ClusterHandles:
    """Wait until every worker has set up and registered itself with the scheduler."""
    import ray

    h.infos = [unpack(b) for b in ray.get(setup_refs, timeout=SETUP_TIMEOUT_S)]
    for info in h.infos:
        log.info("%s on node %s, domain %s, %d KV blocks", info["worker_id"],
                 info["location"]["node"], info["location"]["nvlink_domain"],
                 info["num_total_blocks"])
    return h


def start_workers(cfg: ClusterConfig, *, suffix: str = "") -> ClusterHandles:
    """Start the scheduler and worker actors, wait for their setup, register the workers."""
    return await_workers(*launch_workers(cfg, suffix=suffix))


def served_model_names(cfg: ClusterConfig) -> list[str]:
    """The names the API answers to, the first one primary: ``model.served_name`` (several
    separated by commas), else, as ``vllm serve PATH`` does, the checkpoint's path (so
    clients that load the tokenizer by the model's id, guidellm among them, find it)
    followed by its folder name."""
    if cfg.model.served_name:
        return [n.strip() for n in cfg.model.served_name.split(",") if n.strip()]
    path = resolve_model_path(cfg.model.path)
    return [path, Path(path).name or "model"]


def served_model_name(cfg: ClusterConfig) -> str:
    return served_model_names(cfg)[0]


def build_router_app(cfg: ClusterConfig, handles: ClusterHandles,
                     max_model_len: int | None = None) -> Any:
    """The router bound to the cluster; ``max_model_len`` None: the workers' (set up)."""
    from cluster.router_deployment import router_deployment

    names = served_model_names(cfg)
    return router_deployment().bind(
        cfg.to_dict(), handles.scheduler_name, handles.namespace, list(handles.decode),
        names[0], max_model_len or handles.max_model_len,
        resolve_model_path(cfg.model.path), names[1:])


def declared_max_model_len(cfg: ClusterConfig) -> int | None:
    """The context length the workers will report (the engine takes the checkpoint's
    ``max_position_embeddings``), read from its config.json without loading anything;
    None when the checkpoint does not declare it there."""
    path = Path(resolve_model_path(cfg.model.path)) / "config.json"
    try:
        declared = json.loads(path.read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return declared if isinstance(declared, int) and declared > 1 else None


@dataclass
class RunningCluster:
    cfg: ClusterConfig
    handles: ClusterHandles

    @property
    def url(self) -> str:
        return f"http://{self.cfg.router.host}:{self.cfg.router.port}"

    def shutdown(self) -> None:
        import ray
        from ray import serve

        try:
            serve.delete("tierserve")
        except Exception:  # Serve already gone (Ctrl-C during start)
            log.debug("serve app already deleted")
        for actor in [*self.handles.decode.values(), *self.handles.prefill.values(),
                      self.handles.scheduler]:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead
                continue


def deploy(cfg: ClusterConfig, *, suffix: str = "") -> RunningCluster:
    """Start everything and serve the OpenAI API at ``cfg.router`` host:port."""
    from ray import serve

    cfg = cfg.resolve_presets()
    handles, setup_refs = launch_workers(cfg, suffix=suffix)
    # Serve's controller, its proxy and (when the context length is known without the
    # workers) the router replica start while the workers load the model; /health says
    # 503 until the workers have registered. With direct ingress the replica serves the
    # router's port and Serve's (fallback) proxy takes another one.
    proxy_port = cfg.router.port
    if direct_ingress_port() == cfg.router.port:
        from cluster.testing import free_port

        proxy_port = free_port()
    serve.start(http_options={"host": cfg.router.host, "port": proxy_port})
    max_len = declared_max_model_len(cfg)
    if max_len is None:
        await_workers(handles, setup_refs)
    serve.run(build_router_app(cfg, handles, max_len), name="tierserve", route_prefix="/",
              blocking=False)
    if max_len is not None:
        await_workers(handles, setup_refs)
        if handles.max_model_len != max_len:
            raise RuntimeError(f"the workers serve a context of {handles.max_model_len} "
                               f"tokens, the checkpoint declares {max_len}")
    return RunningCluster(cfg, handles)


# Ray Serve's documented throughput mode: the ingress replica serves HTTP itself (no
# proxy hop, gRPC between Serve's parts, its garbage collector frozen after start). It
# is read when Ray starts, so only a Ray instance started here can have it.
_THROUGHPUT_ENV = "RAY_SERVE_THROUGHPUT_OPTIMIZED"
_DI_MIN, _DI_MAX = "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"
# Serve holds a dead replica's port out of use for 150 s, so that HAProxy workers drop
# their stale route first. Here one replica serves the router's port itself and no HAProxy
# routes to it: the replacement of a crashed replica must take that same port at once.
_PORT_QUARANTINE_ENV = "RAY_SERVE_PORT_QUARANTINE_S"
# Serve drains a direct-ingress replica for at least 30 s before it stops, for a proxy in
# front to stop routing to it; none is in front here, so Ctrl-C need not wait that long.
_DRAIN_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"


def direct_ingress_port() -> int | None:
    """The port the router replica itself serves, when this process started Ray so."""
    if os.environ.get(_THROUGHPUT_ENV) != "1" or _DI_MIN not in os.environ:
        return None
    return int(os.environ[_DI_MIN])


def init_ray(address: str | None, *, num_cpus: int | None = None,
             direct_ingress_port: int | None = None) -> None:
    """Join ``address`` or start a local Ray whose traffic stays on 127.0.0.1.

    ``direct_ingress_port``: a local Ray whose router replica serves that port itself
    (Ray Serve's throughput mode, ``router.direct_ingress``); ignored when joining."""
    import ray

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if ray.is_initialized():
        return
    if not address:
        # Ray starts its workers at nice 15 (its raylet's worker_niceness); on a serving
        # machine the workers are the work, so a Ray instance started here runs them at
        # the same priority as any other process (a benchmark client, a peer server).
        os.environ.setdefault("RAY_worker_niceness", "0")
    if direct_ingress_port is not None and not address:
        os.environ[_THROUGHPUT_ENV] = "1"
        os.environ[_DI_MIN] = str(direct_ingress_port)
        os.environ[_DI_MAX] = str(direct_ingress_port + 1)
        os.environ.setdefault(_PORT_QUARANTINE_ENV, "0")
        os.environ.setdefault(_DRAIN_ENV, "2")
    if address:
        ray.init(address=address, namespace="tierserve", log_to_driver=True)
    else:
        # "local": always a fresh instance, never a `ray start` cluster found on this host.
        ray.init(address="local", namespace="tierserve", include_dashboard=False,
                 num_cpus=num_cpus, _node_ip_address="127.0.0.1")
