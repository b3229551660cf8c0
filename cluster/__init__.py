"""The cluster: configuration, topology, the global scheduler, building and serving the app.

Public API::

    from cluster.config import ClusterConfig, ConfigError, load_config
    cfg = load_config("cluster.yaml", ["pools.num_decode=2"], direct={"model.path": p})
    cfg.tier_config            # scheduler.tiers.TierConfig
    cfg.to_dict() / ClusterConfig.from_dict(d)

    from cluster.topology import WorkerLocation, TopologyClass, topology_class, detect_location
    from cluster.app import init_ray, start_workers, build_router_app, deploy
    running = deploy(cfg)      # scheduler + worker actors + Serve app at cfg.router host:port
    running.url; running.handles.stats(); running.shutdown()

    from cluster.serve_app import app_builder, load_app_config
        # KubeRay's Serve entry point (helm serve.importPath): args {"config_path": ...}
        # -> detached named actors (started or reused) -> the bound Serve app

    from cluster.global_scheduler import GlobalScheduler, WorkerClient, WorkerGone
        # plain class around the kernel's ClusterScheduler: submit_batch, report,
        # finish_batch, abort, worker_failed, notices(router_id); it applies the kernel's
        # plans with concurrent RPCs; why(id), render_metrics(), stats(); tracer=
        # RequestTracer records each closed request (config section `tracing`)
    from cluster.scheduler_actor import scheduler_actor      # the named Ray actor around it
    from cluster.worker_actors import decode_worker_actor, prefill_worker_actor
    from cluster.backend import ClusterBackend, HFTokenizer  # the router's Ray backend
    from cluster.router_deployment import router_deployment  # the Serve ingress

CLI: ``tierserve`` (cluster.cli) maps each subcommand to the module that runs it;
``tierserve serve`` is cluster.serve_cli. The benches and drills it also runs live a floor
up, in ``bench/``. Messages between processes are typed (``scheduler.messages``, msgpack).
"""
