"""The Ray Serve ingress: an OpenAI-compatible HTTP API over a small backend Protocol.

Public API::

    from router.app import build_app, RouterSettings, RequestTiming
    app = build_app(backend, tenants=TenantDirectory(entries, num_tiers), settings=...)
        # /v1/chat/completions, /v1/completions (JSON or SSE), /v1/models, /health,
        # /metrics, /v1/requests/{id}/why; OpenAI error bodies for every refusal
    from router.backend import Backend, GenerationSpec, SamplingSpec, TokenDelta, BackendError
    from router.tenants import TenantDirectory, TenantEntry, TIER_HEADER
    from router.metrics import MetricsRecorder         # Prometheus metrics (ops)

The app never imports Ray; ``cluster/router_deployment.py`` builds it on a Serve replica
around ``cluster.backend.ClusterBackend``.
"""
