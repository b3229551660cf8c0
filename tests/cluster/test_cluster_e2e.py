"""End to end on a local Ray cluster: the openai client, greedy identity, bad input,
client disconnects, a dying decode worker. One Ray start and one deployment per module:
1 prefill + 2 decode workers over a tiny random llama (engine.testing)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MODEL = "tiny"
PROMPTS = [[10, 20, 30, 40, 50], list(range(60, 100)), [7] * 33, list(range(200, 256)) * 2]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    from engine.testing import make_tiny_checkpoint

    torch.set_num_threads(1)
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def cluster(tiny_path: Path) -> Iterator[object]:
    import ray

    from cluster.app import deploy, init_ray
    from cluster.config import load_config
    from cluster.testing import free_port

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    cfg = load_config(overrides=[
        "pools.mode=disaggregated",  # these tests are about prefill -> decode transfers
        f"model.path={tiny_path}", f"model.served_name={MODEL}", f"router.port={free_port()}",
        "model.dtype=float32", "pools.num_prefill=1", "pools.num_decode=2",
        "pools.num_cpus_per_worker=0.25",
        "pools.num_kv_blocks=96", "pools.prefill_chunk_size=32", "router.rpc_timeout_s=5"],
        environ={})
    init_ray(None, num_cpus=4)
    running = deploy(cfg)
    yield running
    running.shutdown()
    from ray import serve

    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def client(cluster: object):  # -> openai.OpenAI
    import openai

    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0,
                         timeout=180)


def _all_blocks_free(cluster: object) -> bool:
    stats = cluster.handles.stats()
    return stats["num_live"] == 0 and all(
        w["free"] == w["total"] for w in stats["workers"].values() if w["alive"])


def test_openai_client_chat_and_completions(client, cluster) -> None:
    msgs = [{"role": "user", "content": "Say hello."}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12,
                                          temperature=0)
    text = chat.choices[0].message.content
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.completion_tokens >= 1 and chat.usage.prompt_tokens > 3
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens

    comp = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=10,
                                     temperature=0)
    parts = list(client.completions.create(model=MODEL, prompt="The sky is", max_tokens=10,
                                           temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == comp.choices[0].text
    assert comp.usage.completion_tokens >= 1
    one = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=1,
                                    temperature=0)
    assert one.usage.completion_tokens == 1
    assert one.choices[0].finish_reason in ("length", "stop")
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    from cluster.testing import wait_until

    assert wait_until(lambda: _all_blocks_free(cluster), 30)


def test_greedy_output_is_token_identical_to_transformers(client, tiny_path) -> None:
    from transformers import AutoTokenizer

    from cluster.testing import greedy_reference

    tok = AutoTokenizer.from_pretrained(str(tiny_path))
    for prompt in PROMPTS:
        ref = greedy_reference(tiny_path, prompt, 24)
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        assert got.usage.completion_tokens == len(ref)
        assert got.choices[0].text == tok.decode(ref, skip_special_tokens=True)


def test_why_and_metrics_endpoints(cluster) -> None:
    import httpx

    r = httpx.post(f"{cluster.url}/v1/completions", timeout=180,
                   json={"model": MODEL, "prompt": "why?", "max_tokens": 4, "priority": 0})
    assert r.status_code == 200
    rid = r.headers["x-tierserve-request-id"]
    why = httpx.get(f"{cluster.url}/v1/requests/{rid}/why", timeout=30)
    assert why.status_code == 200, why.text
    report = why.json()
    assert rid in json.dumps(report) and report.get("text")
    assert httpx.get(f"{cluster.url}/v1/requests/nope/why", timeout=30).status_code == 404
    metrics = httpx.get(f"{cluster.url}/metrics", timeout=30).text
    assert 'tierserve:time_to_first_token_seconds_count{tier="0"}' in metrics
    health = httpx.get(f"{cluster.url}/health", timeout=30).json()
    assert health["status"] == "ok" and health["live_workers"] == {"prefill": 1, "decode": 2}


def test_bad_input_gets_4xx_and_the_cluster_keeps_serving(client, cluster) -> None:
    import httpx
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[5] * 1100, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    r = httpx.post(f"{cluster.url}/v1/chat/completions", content=b"{oops",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(f"{cluster.url}/v1/chat/completions",
                   json={"model": MODEL, "messages": [{"role": "user", "content": 3}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")
    ok = client.completions.create(model=MODEL, prompt="still there?", max_tokens=3)
    assert ok.usage.completion_tokens >= 1


def test_client_disconnect_mid_stream_frees_blocks(cluster) -> None:
    import httpx

    from cluster.testing import wait_until

    body = {"model": MODEL, "prompt": list(range(30, 90)), "max_tokens": 400,
            "temperature": 0.8, "seed": 1, "stream": True}
    with httpx.Client(timeout=180) as http, http.stream(
            "POST", f"{cluster.url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        for n, line in enumerate(r.iter_lines()):
            if line.startswith("data: ") and n > 6:
                assert json.loads(line[6:])["choices"]
                break
    assert wait_until(lambda: _all_blocks_free(cluster), 30)


def test_requests_of_a_router_that_never_reads_free_their_blocks_without_any_abort(
        cluster) -> None:
    """A router replica that goes away sends no abort (Ray Serve may cancel it with the
    request): the decode worker notices that nobody subscribes to the request's tokens
    and the request ends everywhere."""
    import time

    import ray

    from cluster.testing import wait_until
    from scheduler.messages import (
        GenerationSpec,
        SamplingSpec,
        SubmitAnswers,
        SubmitBatch,
        SubmitOutcome,
        decode,
        encode,
    )

    spec = GenerationSpec("reader-gone", tuple(range(30, 90)), SamplingSpec(400, 0.8, 1.0, 1),
                          2, "test", time.time(), router_id="router-that-never-came")
    raw = ray.get(cluster.handles.scheduler.submit.remote(encode(SubmitBatch((spec,)))),
                  timeout=60)
    assert decode(raw, SubmitAnswers).answers[0].outcome is SubmitOutcome.ACCEPTED
    assert wait_until(lambda: cluster.handles.stats()["num_live"] == 1, 10)
    assert wait_until(lambda: cluster.handles.stats()["num_live"] == 0, 40)
    assert wait_until(lambda: _all_blocks_free(cluster), 30)


def test_bench_replays_a_trace_over_http(cluster, tmp_path) -> None:
    import argparse

    from bench import endpoint

    trace = tmp_path / "azure.csv"
    rows = [f"2023-11-16 18:15:{s:02d}.{k}000000,{40 + 97 * k % 900},{5 + 13 * k % 200}"
            for s in range(4) for k in range(1, 6)]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    out = tmp_path / "bench.json"
    p = argparse.ArgumentParser()
    endpoint.add_arguments(p)
    args = p.parse_args(["--url", cluster.url, "--trace", str(trace), "--duration", "10",
                         "--json", str(out), "--policy-label", "tierserve",
                         "--max-output-tokens", "8", "--request-timeout", "60"])
    assert endpoint.run(args) == 0
    summary = json.loads(out.read_text())
    assert summary["policy"] == "tierserve" and summary["requests"] == len(rows)
    assert summary["errors"] == 0
    served = {t: s for t, s in summary["tiers"].items() if s["requests"]}
    assert served and sum(s["requests"] for s in served.values()) == len(rows)
    for s in served.values():
        assert {"ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "attainment",
                "goodput_rps"} <= set(s)
        assert 0 < s["ttft_p50"] <= s["ttft_p99"]
        assert 0.0 <= s["attainment"] <= 1.0


def test_dead_decode_worker_is_retried_with_identical_greedy_output(client, cluster,
                                                                    tiny_path) -> None:
    import ray
    from transformers import AutoTokenizer

    from cluster.testing import greedy_reference, wait_until

    prompt = list(range(100, 140))
    ref = greedy_reference(tiny_path, prompt, 120)
    tok = AutoTokenizer.from_pretrained(str(tiny_path))
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=120,
                                       temperature=0, stream=True)
    pieces = []
    killed = None
    for chunk in stream:
        pieces.append(chunk.choices[0].text if chunk.choices else "")
        if killed is None and len(pieces) >= 3:
            busy = [wid for wid, w in cluster.handles.stats()["workers"].items()
                    if w["role"] == "decode" and w["free"] < w["total"]]
            assert len(busy) == 1
            killed = busy[0]
            ray.kill(cluster.handles.decode[killed], no_restart=True)
    assert killed is not None
    assert "".join(pieces) == tok.decode(ref, skip_special_tokens=True)
    assert wait_until(lambda: not cluster.handles.stats()["workers"][killed]["alive"], 10)
    again = client.completions.create(model=MODEL, prompt=prompt[:10], max_tokens=5,
                                      temperature=0)
    assert again.usage.completion_tokens >= 1
    assert wait_until(lambda: _all_blocks_free(cluster), 30)
