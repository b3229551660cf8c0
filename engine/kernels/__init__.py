"""Small native CPU kernels, compiled on first use for this machine and loaded with ctypes.

Why native code: on CPU, attention over block tables in torch ops means a gather of every
row's blocks, a padded mask and an SDPA call whose tiny per-head GEMMs cost more than the
arithmetic (decode at batch 64 spent ~110 ms a step there, see engine/README.md). The kernel
in ``paged_attention.cpp`` reads K and V through the block table in place.

Why ctypes and not a torch C++ extension: the source includes no torch headers, so it builds
in about a second with the system's g++ (a torch extension takes a minute or more on a
small machine) and the engine passes raw data pointers. The library is built with
``-march=native`` for the CPU it runs on and cached under ``<cache root>/kernels`` by a hash of
the source, the flags, the compiler and the CPU's flags; builds are atomic (a temporary file
renamed), so concurrent workers can race safely.

:func:`load_kernels` returns None (and says why once, on stderr) where no compiler is found
or the build fails: the engine then runs its torch attention path, which gives the same
tokens.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("paged_attention.cpp")
FLAGS = (
    "-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-std=c++17",
    # reassociation lets g++ vectorize the dot products; finite-math is left off (NaN checks)
    "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
)

_c_int64 = ctypes.c_int64
_c_ptr = ctypes.c_void_p
_ARGTYPES = [
    _c_ptr, _c_int64, _c_ptr, _c_int64, _c_int64, _c_int64, _c_int64, _c_ptr, _c_int64, _c_ptr, _c_ptr,
    _c_int64, _c_int64, _c_int64, _c_int64, _c_int64, _c_int64, ctypes.c_float, _c_ptr,
    ctypes.c_int,
]


class PagedAttentionKernel:
    """``attend(...)``: the native paged attention for float32 and bfloat16 pools."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {}
        for dtype, name in ((torch.float32, "tierserve_paged_attention_f32"),
                            (torch.bfloat16, "tierserve_paged_attention_bf16")):
            fn = getattr(lib, name)
            fn.argtypes = _ARGTYPES
            fn.restype = None
            self._fns[dtype] = fn
        self._lib = lib  # keeps the library loaded

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in self._fns

    def attend(
        self,
        query: torch.Tensor,  # [rows, Hq, D], each row's heads contiguous, the pool's dtype
        kv: torch.Tensor,  # the pool [num_blocks, L, 2, block_size, Hkv, D]
        layer: int,
        block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32 contiguous
        row_seq: torch.Tensor,  # [rows] int32: each row's sequence (row of block_tables)
        row_pos: torch.Tensor,  # [rows] int32: each row's position (keys 0..pos attended)
        window: int | None,
        scale: float,
        out: torch.Tensor,  # [rows, Hq, D] contiguous, written
        num_threads: int,
    ) -> None:
        num_rows, num_q_heads, head_dim = query.shape
        _, num_layers, _, block_size, num_kv_heads, _ = kv.shape
        token_stride = num_kv_heads * head_dim
        v_offset = block_size * token_stride
        layer_stride = 2 * v_offset
        if query.stride(2) != 1 or query.stride(1) != head_dim or out.stride(0) != num_q_heads * head_dim:
            raise ValueError("paged attention: each query row's heads must be contiguous")
        self._fns[kv.dtype](
            query.data_ptr(), query.stride(0), kv.data_ptr(), num_layers * layer_stride, layer * layer_stride,
            v_offset, token_stride, block_tables.data_ptr(), block_tables.shape[1],
            row_seq.data_ptr(), row_pos.data_ptr(), num_rows, num_q_heads, num_kv_heads,
            head_dim, block_size, window or 0, scale, out.data_ptr(), num_threads,
        )


_loaded: dict[str, PagedAttentionKernel | None] = {}


def load_kernels() -> PagedAttentionKernel | None:
    """The native kernels (built on first use), or None where they cannot be built here."""
    if "kernels" not in _loaded:
        _loaded["kernels"] = _build_and_load()
    return _loaded["kernels"]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""


def _build_and_load() -> PagedAttentionKernel | None:
    from engine.prepare_model import cache_root

    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        _say("no C++ compiler (g++) found; using the torch attention path")
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
        source = SOURCE.read_bytes()
        key = hashlib.sha256(
            b"\0".join([source, " ".join(FLAGS).encode(), version.encode(), _cpu_flags().encode()])
        ).hexdigest()[:16]
        directory = cache_root() / "kernels"
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / f"paged_attention-{key}.so"
        if not target.exists():
            fd, tmp = tempfile.mkstemp(dir=directory, suffix=".so.tmp")
            os.close(fd)
            try:
                result = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp],
                                        capture_output=True, text=True, timeout=300)
                if result.returncode != 0:
                    _say(f"building {SOURCE.name} failed; using the torch attention path:\n"
                         f"{result.stderr[-2000:]}")
                    return None
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        return PagedAttentionKernel(ctypes.CDLL(str(target)))
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        _say(f"native kernels unavailable ({exc}); using the torch attention path")
        return None


def _say(message: str) -> None:
    print(f"[engine.kernels] {message}", file=sys.stderr, flush=True)
