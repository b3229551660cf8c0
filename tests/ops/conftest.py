"""Shared factories for the ops tests: a forced preemption built with the real state
machine, and the chart with a helm binary (``chart`` fixture).

Story (seconds on the scheduler's clock): tier-3 request ``Y`` decodes on ``decode-1``;
tier-0 request ``X`` arrives at 1.00 while decode-1's KV is full; at 1.30 the scheduler
preempts ``Y`` by swap for ``X`` (blocks freed at 1.38); ``X`` prefills on ``prefill-0``
from 1.42, its KV crosses NVLink domains (same node) from 1.47 to 1.50, and it decodes
5 tokens until 1.70; ``Y`` swaps back in at 1.70 and finishes at 2.00.
"""

from __future__ import annotations

import importlib.util
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.why import RequestLog, TransferInfo
from scheduler.request import Decision, Request, RequestState, transition

S = RequestState


@dataclass
class Scenario:
    logs: dict[str, RequestLog]
    requests: dict[str, Request]
    transfer: TransferInfo


def make_preemption_scenario() -> Scenario:
    y = Request("Y", tier=3, arrival_time=0.0, prompt_len=40, max_new_tokens=64)
    x = Request("X", tier=0, arrival_time=1.0, prompt_len=48, max_new_tokens=5)
    y.prefill_worker_id = x.prefill_worker_id = "prefill-0"
    y.decode_worker_id = x.decode_worker_id = "decode-1"
    transition(y, S.PREFILLING, decision=Decision.SCHEDULE_PREFILL, triggered_by="admission",
               now=0.01, mem_pressure=0.2, slo_slack=599.0)
    transition(y, S.TRANSFERRING, decision=Decision.START_TRANSFER, triggered_by="prefill_done",
               now=0.05)
    transition(y, S.DECODING, decision=Decision.START_DECODE, triggered_by="transfer_done",
               now=0.06)
    y.first_token_time = 0.05
    transition(y, S.PREEMPTING, decision=Decision.PREEMPT_SWAP,
               triggered_by="tier0_arrival:decode-1", now=1.30, mem_pressure=1.0,
               slo_slack=598.0, blocking_req_id="X")
    transition(y, S.PREEMPTED, decision=Decision.PREEMPT_DONE, triggered_by="swap_out_done",
               now=1.38, mem_pressure=0.7)
    transition(x, S.PREFILLING, decision=Decision.SCHEDULE_PREFILL,
               triggered_by="kv_full:decode-1", now=1.42, mem_pressure=0.97, slo_slack=-0.22,
               kv_reuse_hit=2, blocking_req_id="Y")
    transition(x, S.TRANSFERRING, decision=Decision.START_TRANSFER, triggered_by="prefill_done",
               now=1.47)
    x.first_token_time = 1.47
    transition(x, S.DECODING, decision=Decision.START_DECODE, triggered_by="transfer_done",
               now=1.50)
    transition(x, S.FINISHED_LENGTH, decision=Decision.FINISH_LENGTH, triggered_by="max_tokens",
               now=1.70)
    x.num_output_tokens = 5
    transition(y, S.DECODING, decision=Decision.RESUME_SWAP_IN, triggered_by="kv_free:decode-1",
               now=1.70, mem_pressure=0.6)
    transition(y, S.FINISHED_STOPPED, decision=Decision.FINISH_STOP, triggered_by="eos",
               now=2.00)
    y.num_output_tokens = 20
    transfer = TransferInfo(topology_class="same_node", num_bytes=3 * 1024 * 1024, seconds=0.028,
                            src_worker_id="prefill-0", dst_worker_id="decode-1",
                            start_time=1.47)
    logs = {"X": RequestLog.from_request(x, [transfer]), "Y": RequestLog.from_request(y)}
    return Scenario(logs=logs, requests={"X": x, "Y": y}, transfer=transfer)


@pytest.fixture
def scenario() -> Scenario:
    return make_preemption_scenario()


ROOT = Path(__file__).resolve().parents[2]


class Chart:
    """helm/tierserve and a helm binary to lint and render it with."""

    path = ROOT / "helm" / "tierserve"
    two_node_values = path / "ci" / "2node-gpu-values.yaml"
    rayservice_schema = ROOT / "helm" / "schema" / "rayservice.schema.json"

    def __init__(self, helm: Path) -> None:
        self.helm = helm

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.helm), *args], capture_output=True, text=True,
                              timeout=120, cwd=ROOT)

    def render(self, *args: str) -> list[dict[str, Any]]:
        """`helm template` of the chart (release "ts", namespace "llm") as documents."""
        out = self.run("template", "ts", str(self.path), "--namespace", "llm", *args)
        assert out.returncode == 0, out.stderr
        return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="session")
def chart() -> Chart:
    spec = importlib.util.spec_from_file_location(
        "ops_helm_binary", Path(__file__).with_name("helm_binary.py"))
    assert spec is not None and spec.loader is not None
    finder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(finder)
    path, origin = finder.find_helm()
    if path is None:
        pytest.skip(origin)
    return Chart(path)
