"""Cost model: how long prefill chunks, decode steps, transfers and swaps take.

A :class:`Profile` holds one model-on-hardware's constants; :class:`CostModel`
turns them into times and also serves as the kernel's
:class:`scheduler.deadlines.ServiceEstimate` (the same predictions a live
cluster would make from measured figures).

- Prefill of ``n`` new tokens after ``c`` cached ones: FLOPs = 2 x params x n
  (the dense layers) + 4 x layers x hidden x n x (c + n/2) (causal attention),
  at ``peak_flops x mfu``, plus a fixed per-step overhead.
- Decode step over a batch of ``b`` requests holding ``t`` context tokens: the
  larger of reading the weights and the KV (``weight_bytes + t x kv_bytes_per_token``
  at ``hbm_bw x bw_eff``) and the dense FLOPs for ``b`` tokens, plus overhead.
- A mixed step (prefill chunks and decodes in one forward, on a worker that does
  both): the larger of the two fixed costs plus the larger of the memory time and
  the compute time of everything in it; with only chunks or only decodes it is the
  prefill or the decode step above.
- Block moves and swaps: :class:`scheduler.topology.LinkCosts` per class.

The simulator's workers take their step times from here, but the kernel never reads
them directly: each worker's :class:`scheduler.step_costs.StepCosts` learns from the
times of the steps it ran, seeded with the hardware class's generic prior
(:meth:`CostModel.generic_prior`, as an uncalibrated live worker) or, on request, with
:meth:`CostModel.step_prior` (the same linear model, exact for a prefill-only step and
for a memory-bound decode step).
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.step_costs import CPU_PRIOR, GPU_PRIOR
from scheduler.topology import LinkCosts, TopologyClass


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    num_params: float
    num_layers: int
    hidden: int
    kv_bytes_per_token: int
    weight_bytes: float
    peak_flops: float
    mfu: float
    hbm_bw: float
    bw_eff: float
    prefill_overhead_s: float
    decode_overhead_s: float
    kv_blocks_per_worker: int
    block_size: int
    link_bw: dict[TopologyClass, float]
    link_latency: dict[TopologyClass, float]
    host_bw: float
    prefill_chunk_tokens: int
    max_batch: int
    is_gpu: bool = True  # which generic step-cost prior an uncalibrated worker starts from


GB = 1e9

# Llama-3-8B (meta-llama/Meta-Llama-3-8B config.json): 32 layers, hidden 4096,
# 8 KV heads x head_dim 128, 8.03e9 parameters, bf16. KV per token = 2 (K, V) x
# 32 layers x 8 heads x 128 x 2 bytes = 131,072 bytes.
# H200 SXM (NVIDIA H200 Tensor Core GPU datasheet): 141 GB HBM3e, 4.8 TB/s,
# 989 TFLOPS dense BF16, NVLink 900 GB/s (450 GB/s each way), PCIe Gen5 x16
# (64 GB/s each way, ~50 GB/s achieved); cross node: one 400 Gb/s NDR
# InfiniBand NIC per GPU (ConnectX-7, HGX H200 reference design) = 50 GB/s,
# ~25 GB/s achieved for many small block copies (about 18x slower than NVLink,
# DESIGN §6's 10-20x). KV budget: 90 % of 141 GB minus 16 GB weights minus
# ~4 GB activations = ~107 GB = 816k tokens = 51k blocks of 16 tokens.
# Efficiencies: prefill MFU 0.55 and decode bandwidth efficiency 0.75 are in the
# range vLLM/TensorRT-LLM report for 8B models on H100/H200 (e.g. ~3.5-5 ms
# decode step at batch 1 for Llama-3-8B on H200 in NVIDIA's published
# TensorRT-LLM throughput tables, which matches 16 GB / (4.8 TB/s x 0.75) + 0.5 ms).
H200_LLAMA3_8B = Profile(
    name="h200-llama3-8b",
    num_params=8.03e9,
    num_layers=32,
    hidden=4096,
    kv_bytes_per_token=131_072,
    weight_bytes=16.06 * GB,
    peak_flops=989e12,
    mfu=0.55,
    hbm_bw=4.8e12,
    bw_eff=0.75,
    prefill_overhead_s=0.003,
    decode_overhead_s=0.0005,
    kv_blocks_per_worker=51_000,
    block_size=16,
    link_bw={TopologyClass.SAME_DEVICE: 4.8e12 * 0.75, TopologyClass.SAME_DOMAIN: 450 * GB * 0.8,
             TopologyClass.SAME_NODE: 50 * GB, TopologyClass.CROSS_NODE: 25 * GB},
    link_latency={TopologyClass.SAME_DEVICE: 5e-6, TopologyClass.SAME_DOMAIN: 2e-5,
                  TopologyClass.SAME_NODE: 3e-5, TopologyClass.CROSS_NODE: 1e-4},
    host_bw=50 * GB,
    prefill_chunk_tokens=8192,  # vLLM's default max_num_batched_tokens for chunked prefill
    max_batch=256,  # vLLM's default max_num_seqs
)

# SmolLM2-135M (HuggingFaceTB/SmolLM2-135M config.json): 30 layers, hidden 576,
# 3 KV heads x head_dim 64, 1.35e8 parameters, served in bf16 (the engine's "auto"
# on CPUs with native bf16): KV per token = 2 x 30 x 3 x 64 x 2 bytes = 23,040 bytes,
# weights 0.27 GB. Calibrated on the 2-core development machine (one torch thread
# per worker, the cluster's setting) with `tierserve calibrate --json calib.json`
# (bench/calibrate.py, 2026-11-29; thread CPU time, so other jobs do not count):
# prefill of one request is 108 ms + flops / 400 GFLOP/s (64 to 1,024 new tokens:
# 104 to 829 ms); a decode step is 22 ms + max(bytes read / 5.2 GB/s, compute)
# (measured: batch 1 at 128 tokens 60 ms, batch 32 at 1,024 tokens 185 ms; the fit is
# within 25 % at every point). The fixed costs are the Python of a step over 30 layers. Pools, chunk and batch are the cluster's defaults
# (cluster/config.py: 512 blocks of 16 tokens, 256-token chunks, 32 sequences).
# Links: gloo over loopback moves 1 to 3 GB/s with ~1 ms fixed per transfer
# (`tierserve bench-transfer`); swaps are host memcpys (~5 GB/s).
CPU_SMOLLM2 = Profile(
    name="cpu-smollm2",
    num_params=1.35e8,
    num_layers=30,
    hidden=576,
    kv_bytes_per_token=23_040,
    weight_bytes=0.27 * GB,
    peak_flops=400e9,
    mfu=1.0,
    hbm_bw=5.2 * GB,
    bw_eff=1.0,
    prefill_overhead_s=0.108,
    decode_overhead_s=0.022,
    kv_blocks_per_worker=512,
    block_size=16,
    link_bw={TopologyClass.SAME_DEVICE: 5 * GB, TopologyClass.SAME_DOMAIN: 1.5 * GB,
             TopologyClass.SAME_NODE: 1.5 * GB, TopologyClass.CROSS_NODE: 0.1 * GB},
    link_latency={TopologyClass.SAME_DEVICE: 1e-5, TopologyClass.SAME_DOMAIN: 1e-3,
                  TopologyClass.SAME_NODE: 1e-3, TopologyClass.CROSS_NODE: 2e-3},
    host_bw=5 * GB,
    prefill_chunk_tokens=256,
    max_batch=32,
    is_gpu=False,
)

PROFILES: dict[str, Profile] = {p.name: p for p in (H200_LLAMA3_8B, CPU_SMOLLM2)}


class CostModel:
    """Times from a profile; also the kernel's ServiceEstimate."""

    def __init__(self, profile: Profile) -> None:
        p = profile
        self.profile = p
        self.block_size = p.block_size
        self._flops_rate = p.peak_flops * p.mfu
        self.flops_rate = self._flops_rate
        self._dense = 2.0 * p.num_params
        self._attn = 4.0 * p.num_layers * p.hidden
        self._bw = p.hbm_bw * p.bw_eff
        self.links = LinkCosts(bytes_per_block=p.kv_bytes_per_token * p.block_size,
                               bw=dict(p.link_bw), latency=dict(p.link_latency),
                               host_bw=p.host_bw)
        # Typical decode token time for predictions: a batch of 32 at 2k context.
        self._typical_tpot = self.decode_step_s(32, 32 * 2048)

    def prefill_flops(self, new: int, cached: int) -> float:
        return self._dense * new + self._attn * new * (cached + new / 2)

    def prefill_step_s(self, flops: float) -> float:
        return self.profile.prefill_overhead_s + flops / self._flops_rate

    def prefill_s(self, num_new_tokens: int, num_context_tokens: int) -> float:
        """ServiceEstimate: an isolated prefill, in chunks of the step budget."""
        chunk = self.profile.prefill_chunk_tokens
        steps = max(1, -(-num_new_tokens // chunk))
        return (steps * self.profile.prefill_overhead_s
                + self.prefill_flops(num_new_tokens, num_context_tokens) / self._flops_rate)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        p = self.profile
        mem = (p.weight_bytes + context_tokens * p.kv_bytes_per_token) / self._bw
        comp = self._dense * batch / self._flops_rate
        return p.decode_overhead_s + max(mem, comp)

    def decode_token_s(self) -> float:
        return self._typical_tpot

    def step_s(self, prefill_flops: float, num_decodes: int, decode_context: int) -> float:
        """One step of prefill chunks (their FLOPs) and ``num_decodes`` decodes holding
        ``decode_context`` tokens, run as one forward."""
        if not num_decodes:
            return self.prefill_step_s(prefill_flops)
        p = self.profile
        mem = (p.weight_bytes + decode_context * p.kv_bytes_per_token) / self._bw
        comp = (prefill_flops + self._dense * num_decodes) / self._flops_rate
        fixed = max(p.prefill_overhead_s, p.decode_overhead_s) if prefill_flops else p.decode_overhead_s
        return fixed + max(mem, comp)

    def generic_prior(self) -> tuple[float, ...]:
        """What a worker of this hardware class that was never calibrated starts from."""
        return GPU_PRIOR if self.profile.is_gpu else CPU_PRIOR

    def step_prior(self, prefill_only: bool) -> tuple[float, float, float, float, float]:
        """StepCosts coefficients (fixed, per prefill token, per prefill attention unit,
        per decode, per decode context token) from the profile: a prefill worker's fixed
        cost is the prefill step's, a decode worker's the decode step's (its overhead
        plus reading the weights)."""
        p = self.profile
        fixed = p.prefill_overhead_s if prefill_only else p.decode_overhead_s + p.weight_bytes / self._bw
        return (fixed, self._dense / self._flops_rate, self._attn / self._flops_rate, 0.0,
                p.kv_bytes_per_token / self._bw)
