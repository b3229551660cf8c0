"""The head pod's Kubernetes probes on the router's ``/health``: ``python -m cluster.probe``.

KubeRay deploys the Serve application only once the head pod is Ready, and the router
(and its ``/health``) exists only after that deploy. A readiness probe that needed a 200
from ``/health`` would keep the head unready forever. So both probes treat "nothing
listens on the port" as the time before the deploy:

    ready  /health answers 200 -> 0 (ready); nothing listens yet -> 0 (KubeRay may
           deploy); any other answer (503 while the workers load or recover, 404 before
           the app is up), a timeout or a broken answer -> 1 (no traffic to this pod)
    live   /health answers at all, whatever the status, or nothing listens yet -> 0;
           a connection that hangs or answers garbage -> 1 (the kubelet restarts it)

So a degraded cluster (503) stays alive and leaves the Service's endpoints until it
recovers, and a hung server is restarted. Only the standard library is imported: the
probe runs every few seconds as a fresh process.
"""

from __future__ import annotations

import argparse
import enum
import http.client
import sys


class Probe(enum.Enum):
    READY = "ready"
    LIVE = "live"


class Health(enum.Enum):
    OK = "ok"  # 200
    UNHEALTHY = "unhealthy"  # another HTTP status
    NOT_LISTENING = "not_listening"  # connection refused: Serve not deployed yet
    BROKEN = "broken"  # timeout, reset, or not HTTP


def read_health(host: str, port: int, timeout_s: float) -> tuple[Health, str]:
    """What ``GET /health`` on host:port gives, with a line saying so."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", "/health", headers={"accept": "application/json"})
        status = conn.getresponse().status
    except ConnectionRefusedError:
        return Health.NOT_LISTENING, f"nothing listens on {host}:{port} yet"
    except (OSError, http.client.HTTPException) as e:
        return Health.BROKEN, f"{host}:{port}/health: {type(e).__name__}: {e}"
    finally:
        conn.close()
    if status == 200:
        return Health.OK, "ok"
    return Health.UNHEALTHY, f"{host}:{port}/health answered {status}"


def passes(probe: Probe, health: Health) -> bool:
    if health is Health.NOT_LISTENING:
        return True
    if probe is Probe.READY:
        return health is Health.OK
    return health is not Health.BROKEN


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.probe", description=__doc__.split(
        "\n")[0])
    p.add_argument("probe", choices=[x.value for x in Probe])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    args = p.parse_args(argv)
    health, line = read_health(args.host, args.port, args.timeout)
    ok = passes(Probe(args.probe), health)
    print(f"{args.probe}: {'pass' if ok else 'fail'}: {line}", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
