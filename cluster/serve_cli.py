"""``tierserve serve``: start (or join) Ray, deploy the cluster, serve until Ctrl-C.

Single machine: a local Ray instance whose traffic stays on 127.0.0.1
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` makes Ray use the loopback address as the node
address). Multi-node: ``ray start`` on each node, then ``tierserve serve --address auto``.
The default model is the one ``tierserve prepare-model`` builds; ``serve`` builds it
first when it is missing. The router replica starts while the workers load the model.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path

from cluster.config import ConfigError, check_key_files, load_config

READY_TIMEOUT_S = 600.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="YAML configuration (see cluster/config.py)")
    p.add_argument("--model", metavar="PATH", help="model checkpoint (default: the embedded one)")
    p.add_argument("--address", help="Ray address to join (e.g. auto); default: start Ray here")
    p.add_argument("--host", help="HTTP host (default 127.0.0.1; another address needs tenants "
                   "with API keys, or --set router.allow_open_access=true)")
    p.add_argument("--port", type=int, help="HTTP port (default 8000)")
    p.add_argument("--policy", help="scheduling policy (tierserve, vllm-fcfs, ...)")
    p.add_argument("--served-model-name", dest="served_model_name",
                   help="the model name the API answers to (default: the checkpoint "
                   "folder's name)")
    p.add_argument("--num-prefill", type=int, dest="num_prefill")
    p.add_argument("--num-decode", type=int, dest="num_decode")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field, e.g. --set pools.num_kv_blocks=1024")


def _wait_ready(url: str, deadline: float) -> bool:
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return True
        except OSError:
            time.sleep(0.5)
    return False


def run(args: argparse.Namespace) -> int:
    # Before Ray is imported: Ray reads it at import time (loopback node address).
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        cfg = load_config(args.config, args.set, direct={
            "model.path": args.model, "ray_address": args.address, "router.host": args.host,
            "router.port": args.port, "scheduling.policy": args.policy,
            "model.served_name": getattr(args, "served_model_name", None),
            "pools.num_prefill": args.num_prefill, "pools.num_decode": args.num_decode})
        if not cfg.ray_address:  # the router runs here: its key files must be readable
            check_key_files(cfg)
    except ConfigError as e:
        print(f"tierserve serve: configuration error: {e}", file=sys.stderr)
        return 2
    from cluster.app import deploy, init_ray, resolve_model_path

    model = resolve_model_path(cfg.model.path)
    if cfg.model.path == "default":
        from engine.prepare_model import is_prepared, prepare

        if not is_prepared(Path(model)):
            print("tierserve serve: building the embedded default model (once)", flush=True)
            try:
                prepare(Path(model), log=lambda m: print(m, flush=True))
            except (FileNotFoundError, RuntimeError) as e:
                print(f"tierserve serve: could not build the default model: {e}",
                      file=sys.stderr)
                return 2
    if not os.path.exists(model):
        print(f"tierserve serve: no model at {model}; run `tierserve prepare-model` or pass "
              "--model PATH", file=sys.stderr)
        return 2
    import ray

    init_ray(cfg.ray_address,
             direct_ingress_port=cfg.router.port if cfg.router.direct_ingress else None)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    cluster = None
    try:
        cluster = deploy(cfg)
        if not _wait_ready(cluster.url, time.time() + READY_TIMEOUT_S):
            print("tierserve serve: the endpoint did not become ready", file=sys.stderr)
            return 1
        print(f"tierserve: ready at {cluster.url}/v1 (model {model}, policy "
              f"{cfg.scheduling.policy}); Ctrl-C to stop", flush=True)
        print(f"tierserve: {cfg.access_summary()}", flush=True)
        gcs = ray.get_runtime_context().gcs_address
        print(f"tierserve: Ray at {gcs}; a fault drill: tierserve drill --url {cluster.url} "
              f"--address {gcs}", flush=True)
        while not stop.wait(1.0):
            pass
        print("tierserve: shutting down", flush=True)
        return 0
    finally:
        if cluster is not None:
            cluster.shutdown()
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()
