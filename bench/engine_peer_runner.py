"""One side of ``tierserve bench-engine --peer``: a process that loads one engine and runs
what the bench asks, in the bench's process tree.

Standalone on purpose (stdlib at the top): the vLLM side runs it with vLLM's own
interpreter (its virtual environment), which has none of this project's packages; the
tierserve side runs the same file with the project's interpreter.

Protocol: one JSON object per line on stdin; each reply is one line on stdout starting
with ``@@bench `` (vLLM prints to stdout too; other lines are ignored by the bench):

1. ``{"op": "init", "side": "tierserve" | "vllm", "model", "threads", "cores",
   "kv_bytes", "max_num_seqs", "max_num_batched_tokens", "eager"}``: pin the process to
   ``cores``, load the engine, reply with its version;
2. ``{"op": "generate", "prompts": [[token ids]], "max_tokens"}``: greedy, EOS ignored,
   every prompt to exactly ``max_tokens`` tokens; reply ``{"seconds", "outputs"}``;
3. ``{"op": "exit"}``: reply ``{"peak_rss_bytes"}`` (VmHWM of this process) and exit.

Between requests the bench may stop this process (SIGSTOP) while the other side runs, so
vLLM's busy-waiting worker does not take the core the other side is measured on.
"""

from __future__ import annotations

import os
import sys

# Run as a script, this file's folder (engine/) would come first on sys.path, and its
# modules would shadow others (vLLM's `import requests` finding engine/requests.py).
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import json  # noqa: E402
import time  # noqa: E402

MARK = "@@bench "


def reply(obj: dict) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def peak_rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class TierserveSide:
    def __init__(self, init: dict) -> None:
        import torch

        torch.set_num_threads(int(init["threads"]))
        from engine import EngineConfig, LLMEngine, SamplingParams

        self._params = SamplingParams
        self.engine = LLMEngine(EngineConfig(
            model=init["model"], dtype=init.get("dtype", "bfloat16"), kv_cache_bytes=int(init["kv_bytes"]),
            max_num_seqs=int(init["max_num_seqs"]),
            max_num_batched_tokens=int(init["max_num_batched_tokens"]),
            prefill_chunk_size=int(init["max_num_batched_tokens"]),
            enable_prefix_caching=False,
        ))
        import engine

        self.version = getattr(engine, "__version__", None) or _project_version()

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = self._params(max_tokens=max_tokens, ignore_eos=True)
        return self.engine.generate(prompts, params)


class VllmSide:
    def __init__(self, init: dict) -> None:
        import vllm

        self.version = vllm.__version__
        self._params = vllm.SamplingParams
        self.llm = vllm.LLM(
            model=init["model"], dtype=init.get("dtype", "bfloat16"), max_num_seqs=int(init["max_num_seqs"]),
            max_num_batched_tokens=int(init["max_num_batched_tokens"]),
            enforce_eager=bool(init["eager"]), enable_prefix_caching=False, seed=0,
        )

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = self._params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                 use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


def _project_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("tierserve")
    except Exception:
        return None


def main() -> int:
    side = None
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        op = msg["op"]
        try:
            if op == "init":
                cores = msg.get("cores")
                if cores:
                    os.sched_setaffinity(0, set(int(c) for c in cores))
                cls = VllmSide if msg["side"] == "vllm" else TierserveSide
                started = time.perf_counter()
                side = cls(msg)
                reply({"ok": True, "version": side.version,
                       "load_s": round(time.perf_counter() - started, 1)})
            elif op == "generate":
                assert side is not None, "init first"
                started, cpu_started = time.perf_counter(), time.process_time()
                outputs = side.generate(msg["prompts"], int(msg["max_tokens"]))
                # CPU time of the whole process (every thread): on a shared host it counts
                # what this side computed, not the time other jobs held the core
                reply({"ok": True, "seconds": time.perf_counter() - started,
                       "cpu_seconds": time.process_time() - cpu_started, "outputs": outputs})
            elif op == "exit":
                reply({"ok": True, "peak_rss_bytes": peak_rss_bytes()})
                break
            else:
                reply({"ok": False, "error": f"unknown op {op!r}"})
        except Exception as exc:  # reported to the bench, which stops
            reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            if op == "init":
                break
    sys.stdout.flush()
    # vLLM's engine may keep threads alive; this process is done.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
