"""Issue 13's reproduction over HTTP: a normal request's latency alone, sent 1 s after a
normal neighbour, and sent 1 s after a `temperature: 1e-40` request (which used to wedge
the prefill worker's step). Three runs each, 32 tokens, against a running server:

    python scripts/poisoned-request-delay.py http://127.0.0.1:8000
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from typing import Any

import httpx


def main(url: str) -> None:
    client = httpx.Client(base_url=url, timeout=300)
    model = client.get("/v1/models").json()["data"][0]["id"]

    def request(**fields: Any) -> tuple[float, int]:
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 32, **fields}
        t0 = time.perf_counter()
        r = client.post("/v1/completions", json=body)
        seconds = time.perf_counter() - t0
        if r.status_code != 200:
            raise SystemExit(f"{r.status_code}: {r.text}")
        return seconds, r.json()["usage"]["completion_tokens"]

    def normal() -> tuple[float, int]:
        return request(temperature=0.8, seed=1)

    def beside(**neighbour: Any) -> tuple[float, int]:
        thread = threading.Thread(target=request, kwargs={"max_tokens": 64, **neighbour})
        thread.start()
        time.sleep(1.0)
        result = normal()
        thread.join()
        return result

    request(temperature=0)  # warm-up
    runs: dict[str, list[tuple[float, int]]] = {"alone": [], "beside a normal request": [],
                                                "beside temperature 1e-40": []}
    for _ in range(3):
        runs["alone"].append(normal())
        runs["beside a normal request"].append(beside(temperature=0.8, seed=2))
        runs["beside temperature 1e-40"].append(beside(temperature=1e-40))
    for name, got in runs.items():
        shown = ", ".join(f"{s:.2f} s ({n} tokens)" for s, n in got)
        print(f"{name}: {shown}; median {statistics.median(s for s, _ in got):.2f} s")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000")
