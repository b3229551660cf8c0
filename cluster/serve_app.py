"""The Ray Serve application builder KubeRay imports: ``cluster.serve_app:app_builder``.

The Helm chart's RayService names it in ``serveConfigV2`` with
``args: {config_path: /etc/tierserve/config.yaml}`` (the chart's rendered configuration
tree, mounted from its ConfigMap or Secret). Data flow when Serve deploys the app::

    args ──load_app_config──▶ ClusterConfig (file < $TIERSERVE_* < args["set"] overrides)
         ──attach_workers──▶ the named scheduler + workers already running (a redeploy)
           or launch_workers(detached=True) + await_workers (first deploy)
         ──build_router_app──▶ the bound Serve application Serve then runs

The actors are detached: Serve calls the builder in a short-lived task, and the
workers must outlive it. They live in the namespace ``args["namespace"]`` (default
``tierserve``) under their fixed names, so a redeploy (new config, controller restart)
reuses them instead of loading the model again; a changed pool size needs the old
actors removed first (``ray.kill`` them, or restart the RayService).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from cluster.config import ClusterConfig, ConfigError, load_config

log = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "tierserve"
_KNOWN_ARGS = frozenset({"config_path", "set", "namespace"})


def load_app_config(args: Mapping[str, Any]) -> ClusterConfig:
    """The configuration named by Serve's application ``args``.

    ``config_path``: the YAML file (absent: ``$TIERSERVE_CONFIG``, which the chart also
    sets); ``set``: a list of ``KEY=VALUE`` overrides as for ``tierserve serve --set``.
    Unknown keys and a missing file are :class:`ConfigError`.
    """
    if not isinstance(args, Mapping):
        raise ConfigError(f"serve application args: expected a mapping, got {type(args).__name__}")
    unknown = sorted(set(args) - _KNOWN_ARGS)
    if unknown:
        raise ConfigError(f"serve application args: unknown {', '.join(unknown)}; "
                          f"valid: {', '.join(sorted(_KNOWN_ARGS))}")
    overrides = args.get("set") or []
    if isinstance(overrides, str) or not all(isinstance(o, str) for o in overrides):
        raise ConfigError("serve application args.set: expected a list of KEY=VALUE strings")
    path = args.get("config_path")
    if path is not None and not os.path.isfile(str(path)):
        raise ConfigError(f"serve application args.config_path: no file at {path}")
    return load_config(path, list(overrides))


def app_builder(args: dict[str, Any]) -> Any:
    """Ray Serve's entry point: start (or reuse) the cluster's actors, return the app."""
    import ray

    from cluster.app import attach_workers, await_workers, build_router_app, launch_workers

    cfg = load_app_config(args)
    log.info("tierserve %s", cfg.access_summary())
    namespace = str(args.get("namespace") or DEFAULT_NAMESPACE)
    if not ray.is_initialized():  # Serve runs builders inside Ray; a plain script may not
        ray.init(address=cfg.ray_address or "auto", namespace=namespace)
    handles = attach_workers(cfg, namespace)
    if handles is None:
        log.info("starting %d prefill + %d decode workers in namespace %s",
                 cfg.pools.num_prefill, cfg.pools.num_decode, namespace)
        handles = await_workers(*launch_workers(cfg, namespace=namespace, detached=True))
    else:
        log.info("reusing the running scheduler and %d workers in namespace %s",
                 len(handles.prefill) + len(handles.decode), namespace)
    return build_router_app(cfg, handles)
