"""Engine configuration: one frozen, validated value built at the config boundary."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from engine.errors import EngineSettingError


class DTypeChoice(enum.Enum):
    AUTO = "auto"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"  # CUDA only
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
    """The torch dtype of ``choice`` on ``device``; EngineSettingError (``dtype``) where the
    device cannot run it: float16 on CPU, bfloat16 on a GPU without bf16. (bfloat16 on a CPU
    without AVX512-BF16 or AMX runs, emulated and slowly; "auto" picks float32 there.)"""
    choice = _dtype_choice(choice)
    if choice is DTypeChoice.FLOAT32:
        return torch.float32
    if choice is DTypeChoice.FLOAT16:
        if device.type != "cuda":
            raise EngineSettingError(
                "dtype", f"float16 does not run on {device.type}; choose auto, bfloat16 or float32")
        return torch.float16
    if choice is DTypeChoice.BFLOAT16:
        if device.type == "cuda" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            major, minor = torch.cuda.get_device_capability(device)
            raise EngineSettingError(
                "dtype", f"bfloat16 needs a GPU of compute capability 8.0 or more, this one is "
                f"{major}.{minor}; choose auto, float16 or float32")
        return torch.bfloat16
    return torch.bfloat16 if bf16_supported(device) else torch.float32


def _dtype_choice(choice: str | DTypeChoice) -> DTypeChoice:
    try:
        return DTypeChoice(choice)
    except ValueError:
        names = ", ".join(c.value for c in DTypeChoice)
        raise EngineSettingError("dtype", f"{choice!r} is not one of {names}") from None


class AttentionChoice(enum.Enum):
    AUTO = "auto"  # flex on CUDA, paged on CPU
    PAGED = "paged"  # block-major pool: native CPU kernels (or torch ops) through block tables
    FLEX = "flex"  # layer-major pool: FlexAttention through block tables (engine.flex_attention)


def resolve_attention(choice: str | AttentionChoice, device: torch.device) -> AttentionChoice:
    """The attention path of ``choice`` on ``device`` (AUTO resolved); EngineSettingError
    (``attention``) for a value that is not a choice or a path this torch cannot run."""
    try:
        choice = AttentionChoice(choice)
    except ValueError:
        names = ", ".join(c.value for c in AttentionChoice)
        raise EngineSettingError("attention", f"{choice!r} is not one of {names}") from None
    if choice is AttentionChoice.AUTO:
        choice = AttentionChoice.FLEX if device.type == "cuda" else AttentionChoice.PAGED
    if choice is AttentionChoice.FLEX:
        from engine.flex_attention import flex_available

        if not flex_available():
            raise EngineSettingError(
                "attention", f"flex needs torch.nn.attention.flex_attention (torch >= 2.5), "
                f"this torch is {torch.__version__}; choose paged")
    return choice


def check_device(device: torch.device) -> None:
    """EngineSettingError (``device``) when torch cannot reach ``device``."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise EngineSettingError("device", f"{device} asked, but torch sees no CUDA device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise EngineSettingError(
                "device", f"{device} asked, but there are {torch.cuda.device_count()} CUDA devices")


@dataclass(frozen=True)
class EngineConfig:
    """What one engine runs and how much memory it may use.

    The KV budget is, in order of precedence: ``num_kv_blocks``, ``kv_cache_bytes``, or
    ``kv_cache_fraction`` of the device's available memory when the engine starts (host
    MemAvailable on CPU, free memory after the weights on CUDA). The default, a tenth, leaves
    a CPU host room for a second worker, Ray and the OS (engine/README.md: on a 24 GiB
    machine ~2 GiB per worker, ~90,000 tokens of SmolLM2-135M in bf16). A budget larger than
    the available memory is an EngineSettingError naming the field. The pool is allocated
    (and touched) once at start, so resident memory does not grow while serving.
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
    # How attention reads the pool: "auto" (flex on CUDA, paged on CPU), "paged" or "flex"
    # (AttentionChoice); flex on CPU runs FlexAttention's eager reference (tests).
    attention: str = "auto"
    # CUDA graphs of decode-only steps for batches up to this size (padded to 1, 2, 4, 8,
    # then multiples of 8); 0 turns them off. Only on CUDA with flex attention.
    cuda_graph_max_batch: int = 64

    def __post_init__(self) -> None:
        choice = _dtype_choice(self.dtype)  # EngineSettingError naming the bad value
        resolve_attention(self.attention, torch.device("cpu"))  # a valid choice, at least
        if self.cuda_graph_max_batch < 0:
            raise EngineSettingError(
                "cuda_graph_max_batch", f"must be >= 0, got {self.cuda_graph_max_batch}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise EngineSettingError("device", f"must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if choice is DTypeChoice.FLOAT16 and self.device == "cpu":
            raise EngineSettingError(
                "dtype", "float16 does not run on cpu; choose auto, bfloat16 or float32")
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
            raise EngineSettingError("num_kv_blocks", f"must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise EngineSettingError("kv_cache_bytes", f"must be >= 1, got {self.kv_cache_bytes}")
        if not 0.0 < self.kv_cache_fraction <= 0.95:
            raise EngineSettingError(
                "kv_cache_fraction", f"must be in (0, 0.95], got {self.kv_cache_fraction}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (one token per seq)")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)
