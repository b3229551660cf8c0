"""The engine's own forward of the Llama family (Llama, Qwen2, Mistral) over the paged KV pool.

Why not transformers' forward: at the batch sizes a serving step has, a step's time went
mostly to the per-layer machinery around the arithmetic (module calls, kwargs, masks,
separate q/k/v and gate/up projections, rotary in a dozen small ops, the attention adapter):
a 16-token prefill of SmolLM2-135M took ~85 ms where its GEMMs take ~30 (engine/README.md).
This forward runs the same arithmetic in the same order with the fewest ops:

    per step:  embed ─▶ cos/sin of every position (the model's own rotary module, once)
    per layer: rms_norm ─▶ one q|k|v GEMM ─▶ rotary on q|k at once ─▶ K, V into the pool
               ─▶ paged attention (engine.attention) ─▶ o GEMM + residual ─▶ rms_norm
               ─▶ one gate|up GEMM ─▶ act(gate) * up ─▶ down GEMM + residual
    at the end: final norm and the LM head on the sampled rows only

The weights stay the transformers model's own: q/k/v (and gate/up) are concatenated into one
matrix per layer and the model's parameters are replaced by views of it, so nothing is held
twice and the transformers model keeps working (``generate`` on it gives the reference).
Norms and rotary are computed exactly as transformers computes them, so float32 greedy
output matches ``model.generate`` token for token.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention import PagedAttention, StepMeta

_packed_linear = torch.ops.mkldnn._linear_pointwise


class Projection:
    """One linear map of the forward: ``F.linear``, or oneDNN's linear over a weight packed
    once (bf16 on CPU: the plain bf16 linear repacks the weight on every call; float32:
    oneDNN's packed GEMM ran 1.1-1.4x faster than MKL's from 2 to 1,024 rows on AVX2).

    A packed linear runs on a number of rows from a bounded set (``padded_rows``): oneDNN
    builds and caches a primitive for every input shape, and a server sees a new row count
    at almost every prefill. Measured on fp32 packed linears with every count from 17 to
    1,200 rows: resident memory 291 -> 2,692 MiB (512 MiB in oneDNN's primitive cache at its
    1,024-entry capacity, the rest heap fragmented by the cache's churn); with the rows
    padded to the set below, 292 -> 408 MiB over the same calls, flat once each size has
    run. Rows are independent, so padding changes no result bit (checked).
    """

    __slots__ = ("weight", "bias", "packed", "min_packed_rows")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool) -> None:
        self.weight = weight
        self.bias = bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_HINT) if pack else None
        # float32 at one row: MKL's GEMV beat the packed linear by ~30 % on the layer
        # weights (AVX2, CPU time); from two rows on the packed one wins (1.3-1.8x)
        self.min_packed_rows = 2 if weight.dtype == torch.float32 else 1

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.shape[0] < self.min_packed_rows:
            return F.linear(x, self.weight, self.bias)
        rows = x.shape[0]
        padded = padded_rows(rows)
        if padded == rows:
            return _packed_linear(x, self.packed, self.bias, "none", [], "")
        full = x.new_zeros(padded, x.shape[1])
        full[:rows] = x
        return _packed_linear(full, self.packed, self.bias, "none", [], "")[:rows]


def padded_rows(rows: int) -> int:
    """The row count a packed linear runs for ``rows``: exact up to 8, then multiples of 8
    to 64, of 32 to 512, of 128 beyond (about 60 sizes up to 4,096; small counts are bound
    by the weights' traffic, so their padding costs little, large ones pad by < 25 %)."""
    if rows <= 8:
        return rows
    step = 8 if rows <= 64 else 32 if rows <= 512 else 128
    return (rows + step - 1) // step * step


def can_pack_bf16() -> bool:
    """Whether oneDNN runs packed bf16 linears on this CPU (it needs AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT; on an AVX2-only CPU the reorder raises, and bf16 stays on F.linear)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


# The batch size oneDNN packs for; 1, 16 and 64 measured the same at batch 1 to 64.
PACK_HINT = 16
PACK = True  # False: plain F.linear everywhere (the A/B switch of engine/README.md)


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Projection  # [(Hq + 2 Hkv) * D, hidden]
    o: Projection
    gate_up: Projection  # [2 * intermediate, hidden]
    down: Projection
    act: object  # the MLP's activation module (SiLU for all three families)
    is_silu: bool
    sliding_window: int | None


class LlamaFamilyForward:
    """``forward(input_ids, positions, meta, sample_rows) -> logits[len(sample_rows), vocab]``
    (``sample_rows`` None: every row, in order)."""

    def __init__(self, model: torch.nn.Module, attention: PagedAttention) -> None:
        config = model.config
        self.attention = attention
        self.num_q_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None)
                            or config.hidden_size // config.num_attention_heads)
        base = model.model
        self.embed = base.embed_tokens.weight
        self.final_norm = base.norm.weight
        self.eps = float(base.norm.variance_epsilon)
        dtype = self.embed.dtype
        pack = PACK and self.embed.device.type == "cpu" and (
            dtype == torch.float32 or (dtype == torch.bfloat16 and can_pack_bf16()))
        self.lm_head = _cached(model.lm_head, pack, lambda: Projection(
            model.lm_head.weight, getattr(model.lm_head, "bias", None), pack))
        self.rotary = base.rotary_emb
        self.layers = [_cached(layer, pack, lambda layer=layer: _layer_weights(layer, config, pack))
                       for layer in base.layers]
        self.scaling = float(base.layers[0].self_attn.scaling)
        kernels = attention.kernel
        # The fused bf16 path (engine.kernels.fused_ops): one kernel for each of residual
        # add + norm, rotary + KV write, SiLU * up. float32 keeps torch's ops, op for op.
        self.fused = (kernels is not None and self.embed.dtype == torch.bfloat16
                      and self.embed.device.type == "cpu" and self.head_dim % 2 == 0)
        self.fused_mlp = self.fused and all(w.is_silu for w in self.layers)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMeta,
                 sample_rows: torch.Tensor | None) -> torch.Tensor:
        if self.fused:
            return self._fused(input_ids, positions, meta, sample_rows)
        num_tokens = input_ids.shape[0]
        hq, hkv, d = self.num_q_heads, self.num_kv_heads, self.head_dim
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary(x, positions.unsqueeze(0))
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [T, 1, D]
        half = d // 2
        qk_width = (hq + hkv) * d
        attention = self.attention
        for index, w in enumerate(self.layers):
            h = _rms_norm(x, w.input_norm, self.eps)
            qkv = w.qkv(h)
            qk = qkv[:, :qk_width].view(num_tokens, hq + hkv, d)
            # rotary exactly as transformers: x * cos + rotate_half(x) * sin
            rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
            qk = qk * cos + rotated * sin
            v = qkv[:, qk_width:].view(num_tokens, hkv, d)
            out = attention.forward(index, qk[:, :hq], qk[:, hq:], v, meta, w.sliding_window,
                                    self.scaling)
            x = x + w.o(out)
            h = _rms_norm(x, w.post_norm, self.eps)
            gate_up = w.gate_up(h)
            inter = gate_up.shape[-1] // 2
            x = x + w.down(w.act(gate_up[:, :inter]) * gate_up[:, inter:])
        if sample_rows is not None:
            x = x.index_select(0, sample_rows)
        return self.lm_head(_rms_norm(x, self.final_norm, self.eps))


    def _fused(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMeta,
               sample_rows: torch.Tensor | None) -> torch.Tensor:
        kernels = self.attention.kernel
        assert kernels is not None
        num_tokens = input_ids.shape[0]
        hq, hkv, d = self.num_q_heads, self.num_kv_heads, self.head_dim
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary(x, positions.unsqueeze(0))
        cos, sin = cos[0].contiguous(), sin[0].contiguous()  # [T, D]
        q_width, kv_width = hq * d, hkv * d
        attention = self.attention
        delta: torch.Tensor | None = None  # the last sublayer's output, not yet added to x
        for index, w in enumerate(self.layers):
            h = kernels.add_rms_norm(x, delta, w.input_norm, self.eps)
            qkv = w.qkv(h)
            kernels.rope_store(qkv, hq, hkv, d, cos, sin, meta.kv, meta.slot_rows, index)
            q = qkv[:, :q_width].view(num_tokens, hq, d)
            k = qkv[:, q_width : q_width + kv_width].view(num_tokens, hkv, d)
            v = qkv[:, q_width + kv_width :].view(num_tokens, hkv, d)
            out = attention.forward(index, q, k, v, meta, w.sliding_window, self.scaling,
                                    kv_written=True)
            h = kernels.add_rms_norm(x, w.o(out), w.post_norm, self.eps)
            gate_up = w.gate_up(h)
            if self.fused_mlp:
                act = kernels.silu_mul(gate_up)
            else:
                inter = gate_up.shape[-1] // 2
                act = w.act(gate_up[:, :inter]) * gate_up[:, inter:]
            delta = w.down(act)
        if sample_rows is not None:
            x, delta = x.index_select(0, sample_rows), delta.index_select(0, sample_rows)
        return self.lm_head(kernels.add_rms_norm(x, delta, self.final_norm, self.eps))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op (float32 statistics, weight times the cast)."""
    h = x.float()
    scale = h.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return weight * (h * scale).to(x.dtype)


# Per module, what was built from it (an engine per test case may share one loaded model,
# and the fusion replaces the module's parameters, so it must happen once).
_built: weakref.WeakKeyDictionary[torch.nn.Module, dict[bool, object]] = (
    weakref.WeakKeyDictionary()
)


def _cached(module: torch.nn.Module, pack: bool, build):
    entry = _built.setdefault(module, {})
    if pack not in entry:
        entry[pack] = build()
    return entry[pack]


def _layer_weights(layer: torch.nn.Module, config: object, pack: bool) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    window = getattr(attn, "sliding_window", None)
    if window is None and type(attn).__name__.startswith("Mistral"):
        window = getattr(config, "sliding_window", None)
    return LayerWeights(
        input_norm=layer.input_layernorm.weight,
        post_norm=layer.post_attention_layernorm.weight,
        qkv=Projection(*_fuse([attn.q_proj, attn.k_proj, attn.v_proj]), pack),
        o=Projection(attn.o_proj.weight, attn.o_proj.bias, pack),
        gate_up=Projection(*_fuse([mlp.gate_proj, mlp.up_proj]), pack),
        down=Projection(mlp.down_proj.weight, mlp.down_proj.bias, pack),
        act=mlp.act_fn,
        is_silu=isinstance(mlp.act_fn, torch.nn.SiLU)
        or type(mlp.act_fn).__name__ in ("SiLUActivation", "SiLU"),
        sliding_window=int(window) if window else None,
    )


def _fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several Linear layers of the same input; each layer's
    parameters become views of it, so the memory is not held twice."""
    weight = torch.cat([lin.weight.detach() for lin in linears], dim=0)
    has_bias = [lin.bias is not None for lin in linears]
    bias = None
    if any(has_bias):
        bias = torch.cat([
            lin.bias.detach() if lin.bias is not None
            else torch.zeros(lin.out_features, dtype=weight.dtype, device=weight.device)
            for lin in linears
        ])
    row = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = torch.nn.Parameter(weight[row : row + n], requires_grad=False)
        if bias is not None and lin.bias is not None:
            lin.bias = torch.nn.Parameter(bias[row : row + n], requires_grad=False)
        row += n
    return weight, bias
