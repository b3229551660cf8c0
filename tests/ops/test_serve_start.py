"""``tierserve serve`` starts quietly and honestly (issue 13, item 9): while a client polls
/health from the first moment (as scripts/time-make-serve.sh and any load balancer do),
the output shows no traceback, /health answers 503 until the workers have registered and
200 after, the ready line names the endpoint and the Ray address a drill joins, and
Ctrl-C stops it. Runs the real command in its own process group (its own local Ray) over
a tiny random checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 120.0


def _health(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0  # not listening yet


def test_serve_starts_without_a_traceback_while_health_is_polled(tmp_path: Path) -> None:
    import torch

    from cluster.testing import free_port
    from engine.testing import make_tiny_checkpoint

    torch.set_num_threads(1)
    model = make_tiny_checkpoint("llama", tmp_path / "tiny")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cluster.cli", "serve", "--model", str(model), "--port",
             str(port), "--set", "model.dtype=float32", "--set", "pools.num_kv_blocks=64",
             "--set", "pools.num_cpus_per_worker=0.25"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    statuses: list[int] = []
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            statuses.append(_health(url))
            if statuses[-1] == 200 and b"Ray at" in log.read_bytes():
                break
            time.sleep(0.2)
        assert statuses and statuses[-1] == 200, log.read_text()[-4000:]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(STOP_TIMEOUT_S) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:  # never leave its Ray behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    text = log.read_text()
    assert "Traceback" not in text, text
    assert set(statuses) <= {0, 503, 200}, statuses  # refused, unavailable, then ready
    ready = [line for line in text.splitlines() if line.startswith("tierserve: ")]
    assert any(f"ready at {url}/v1" in line for line in ready), text
    assert any("tierserve drill --url" in line and "--address 127.0.0.1:" in line
               for line in ready), text
