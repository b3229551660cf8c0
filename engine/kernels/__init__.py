"""Small native CPU kernels, compiled on first use for this machine and loaded with ctypes.

Why native code: on CPU, attention over block tables in torch ops means a gather of every
row's blocks, a padded mask and an SDPA call whose tiny per-head GEMMs cost more than the
arithmetic (decode at batch 64 spent ~110 ms a step there, see engine/README.md). The kernel
in ``paged_attention.cpp`` reads K and V through the block table in place;
``fused_ops.cpp`` does a layer's bf16 elementwise steps (residual add and RMS norm, SiLU
and multiply, rotary and the KV write) in one pass each, and the greedy argmax;
``prefill_attention.cpp`` is a bf16 flash attention for long prefill chunks on CPUs with
AVX512-BF16 (where the compiler targets it; ``has_prefill_attention`` says).

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

SOURCES = tuple(Path(__file__).with_name(n) for n in (
    "paged_attention.cpp", "fused_ops.cpp", "prefill_attention.cpp"))
HEADERS = (Path(__file__).with_name("simd.h"),)
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


def _fn(lib: ctypes.CDLL, name: str, argtypes: list) -> object:
    fn = getattr(lib, name)
    fn.argtypes = argtypes
    fn.restype = None
    return fn


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class NativeKernels:
    """The native kernels: paged attention (float32 and bfloat16 pools), and the fused bf16
    layer steps and greedy argmax. Every tensor argument must be a contiguous CPU tensor of
    the stated dtype, unless said otherwise."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {
            torch.float32: _fn(lib, "tierserve_paged_attention_f32", _ARGTYPES),
            torch.bfloat16: _fn(lib, "tierserve_paged_attention_bf16", _ARGTYPES),
        }
        i64, ptr, f32, i32 = _c_int64, _c_ptr, ctypes.c_float, ctypes.c_int
        self._add_rms_norm = _fn(lib, "tierserve_add_rms_norm_bf16",
                                 [ptr, ptr, ptr, ptr, i64, i64, f32, i32])
        self._silu_mul = _fn(lib, "tierserve_silu_mul_bf16", [ptr, ptr, i64, i64, i32])
        self._rope_store = _fn(lib, "tierserve_rope_store_bf16",
                               [ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, i64, i64, i32])
        self._argmax = _fn(lib, "tierserve_argmax_f32", [ptr, i64, i64, i64, ptr, i32])
        self._prefill = None
        if hasattr(lib, "tierserve_prefill_attention_bf16"):
            self._prefill = _fn(lib, "tierserve_prefill_attention_bf16",
                                [ptr, i64, ptr, i64, i64, i64, i64, ptr, i64, i64, i64, i64,
                                 i64, i64, i64, f32, ptr, i64, i32])
            self._prefill.restype = ctypes.c_int
        self._lib = lib  # keeps the library loaded
        self.num_threads = 1  # OpenMP threads of every call (the runner sets torch's count)

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """bf16 ``x += delta`` (in place, when given), then transformers' RMS norm of x."""
        rows, dim = x.shape
        out = torch.empty_like(x)
        self._add_rms_norm(x.data_ptr(), _ptr(delta), weight.data_ptr(), out.data_ptr(), rows,
                           dim, eps, self.num_threads)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """bf16 [T, 2I] (gate | up) -> silu(gate) * up [T, I]."""
        rows, width = gate_up.shape
        out = gate_up.new_empty(rows, width // 2)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, self.num_threads)
        return out

    def rope_store(self, qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                   head_dim: int, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
                   slot_rows: torch.Tensor, layer: int) -> None:
        """Rotary on the q and k heads of bf16 ``qkv`` [T, (Hq + 2 Hkv) * D] in place, and
        each token's k and v into the pool (the rows of engine.attention's ``slot_rows``)."""
        block_size = kv.shape[3]
        k_offset = layer * 2 * block_size
        self._rope_store(qkv.data_ptr(), qkv.shape[0], num_q_heads, num_kv_heads, head_dim,
                         cos.data_ptr(), sin.data_ptr(), kv.data_ptr(), slot_rows.data_ptr(),
                         k_offset, k_offset + block_size, self.num_threads)

    @property
    def has_prefill_attention(self) -> bool:
        return self._prefill is not None

    def prefill_attend(self, query: torch.Tensor, kv: torch.Tensor, layer: int,
                       block_table: torch.Tensor, first_pos: int, window: int | None,
                       scale: float, out: torch.Tensor) -> bool:
        """Causal attention of one bf16 chunk: ``query`` [n, Hq, D] (each row's heads
        contiguous) at positions first_pos.., keys 0..first_pos + n - 1 read through
        ``block_table`` (int32); writes ``out`` [n, Hq, D] (rows may be strided). False:
        no kernel for this head_dim (nothing written)."""
        if self._prefill is None:
            return False
        num_queries, num_q_heads, head_dim = query.shape
        _, num_layers, _, block_size, num_kv_heads, _ = kv.shape
        if query.stride(2) != 1 or query.stride(1) != head_dim or out.stride(1) != head_dim:
            raise ValueError("prefill attention: each row's heads must be contiguous")
        token_stride = num_kv_heads * head_dim
        v_offset = block_size * token_stride
        layer_stride = 2 * v_offset
        done = self._prefill(
            query.data_ptr(), query.stride(0), kv.data_ptr(), num_layers * layer_stride,
            layer * layer_stride, v_offset, token_stride, block_table.data_ptr(), num_queries,
            first_pos, num_q_heads, num_kv_heads, head_dim, block_size, window or 0, scale,
            out.data_ptr(), out.stride(0), self.num_threads)
        return done == 0

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 [n, vocab] (rows may be strided) -> long [n], as ``max(dim=-1).indices``."""
        rows, cols = logits.shape
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        out = torch.empty(rows, dtype=torch.long)
        self._argmax(logits.data_ptr(), rows, cols, logits.stride(0), out.data_ptr(),
                     self.num_threads)
        return out

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
    ) -> None:
        num_rows, num_q_heads, head_dim = query.shape
        _, num_layers, _, block_size, num_kv_heads, _ = kv.shape
        token_stride = num_kv_heads * head_dim
        v_offset = block_size * token_stride
        layer_stride = 2 * v_offset
        if (query.stride(2) != 1 or query.stride(1) != head_dim
                or out.stride(0) != num_q_heads * head_dim):
            raise ValueError("paged attention: each query row's heads must be contiguous")
        self._fns[kv.dtype](
            query.data_ptr(), query.stride(0), kv.data_ptr(), num_layers * layer_stride,
            layer * layer_stride, v_offset, token_stride, block_tables.data_ptr(), block_tables.shape[1],
            row_seq.data_ptr(), row_pos.data_ptr(), num_rows, num_q_heads, num_kv_heads,
            head_dim, block_size, window or 0, scale, out.data_ptr(), self.num_threads,
        )


_loaded: dict[str, NativeKernels | None] = {}


def load_kernels() -> NativeKernels | None:
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


def _build_and_load() -> NativeKernels | None:
    from engine.prepare_model import cache_root

    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        _say("no C++ compiler (g++) found; using the torch attention path")
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
        sources = [p.read_bytes() for p in (*SOURCES, *HEADERS)]
        key = hashlib.sha256(
            b"\0".join([*sources, " ".join(FLAGS).encode(), version.encode(),
                        _cpu_flags().encode()])
        ).hexdigest()[:16]
        directory = cache_root() / "kernels"
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / f"tierserve_kernels-{key}.so"
        if not target.exists():
            fd, tmp = tempfile.mkstemp(dir=directory, suffix=".so.tmp")
            os.close(fd)
            try:
                result = subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", tmp],
                                        capture_output=True, text=True, timeout=300)
                if result.returncode != 0:
                    _say(f"building the native kernels failed; using torch ops:\n"
                         f"{result.stderr[-2000:]}")
                    return None
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        return NativeKernels(ctypes.CDLL(str(target)))
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        _say(f"native kernels unavailable ({exc}); using the torch attention path")
        return None


def _say(message: str) -> None:
    print(f"[engine.kernels] {message}", file=sys.stderr, flush=True)
