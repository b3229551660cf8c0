"""Engine configuration: one frozen, validated value built at the config boundary."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class DTypeChoice(enum.Enum):
    AUTO = "auto"
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"


def bf16_supported(device: torch.device) -> bool:
    """bf16 where the device does it natively: CUDA with bf16 support, CPUs with AVX512-BF16/AMX.

    On other CPUs torch still computes bf16, but slowly (emulated), so "auto" picks float32.
    """
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        try:
            capability = torch.backends.cpu.get_cpu_capability()
        except Exception:  # older torch without the probe: be safe
            return False
        if "AVX512" in capability:
            try:
                with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
                    flags = f.read()
            except OSError:
                return False
            return "avx512_bf16" in flags or "amx_bf16" in flags
        return False
    return False


def resolve_dtype(choice: str | DTypeChoice, device: torch.device) -> torch.dtype:
    choice = DTypeChoice(choice)
    if choice is DTypeChoice.FLOAT32:
        return torch.float32
    if choice is DTypeChoice.BFLOAT16:
        return torch.bfloat16
    return torch.bfloat16 if bf16_supported(device) else torch.float32


@dataclass(frozen=True)
class EngineConfig:
    """What one engine runs and how much memory it may use.

    The KV budget is, in order of precedence: ``num_kv_blocks``, ``kv_cache_bytes``, or
    ``kv_cache_fraction`` of the device's free memory. The pool is allocated (and touched)
    once at start, so resident memory does not grow while serving.
    """

    model: str
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    kv_cache_fraction: float = 0.1
    # One chunk of up to max_num_batched_tokens by default: on CPU, large GEMMs are what make
    # prefill fast; set it lower to bound how long decodes sharing a step wait.
    prefill_chunk_size: int = 2048
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    # The native CPU kernels (engine.kernels, built on first use); False, or no compiler on
    # the machine: torch ops only (same greedy tokens, slower decode).
    native_kernels: bool = True

    def __post_init__(self) -> None:
        DTypeChoice(self.dtype)  # raises ValueError naming the bad value
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        positive = {
            "block_size": self.block_size,
            "prefill_chunk_size": self.prefill_chunk_size,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        if not 0.0 < self.kv_cache_fraction <= 0.95:
            raise ValueError(f"kv_cache_fraction must be in (0, 0.95], got {self.kv_cache_fraction}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (one token per seq)")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)
