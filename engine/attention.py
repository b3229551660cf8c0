"""Attention over block tables, plugged into transformers as ``attn_implementation="tierserve_paged"``.

One forward runs one packed batch: every scheduled token of every request, flattened into
``input_ids[1, total_tokens]`` with explicit ``position_ids``. Decode tokens come first (one per
request), then the prefill chunks. The model's attention modules call
:func:`paged_attention_forward` with the new tokens' Q, K, V (rotary already applied) and the
per-forward :class:`ForwardBatch` (passed as the ``tierserve_batch`` model kwarg), which:

1. writes the new K and V into the pool, viewed as rows ``[num_blocks * L * 2 * block_size, H,
   D]`` (block-major, see engine.block_pool): a token's row for layer ``l`` is its
   ``token_rows`` entry (layer 0's K) plus ``l * 2 * block_size`` (K) or ``block_size`` more (V);
2. decode rows (sorted by context length, in a few groups of similar lengths): gathers each
   group's blocks with one ``index_select`` per layer and K|V and runs one SDPA per group (queries
   grouped per KV head, keys masked past each request's length; the token batch itself is
   never padded);
3. each prefill chunk: attends causally to its own tokens and to the request's cached prefix
   (gathered from its blocks); a chunk with no prefix attends to its own K/V directly.

Sliding-window layers (Mistral, some Qwen2) get the window in their masks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "tierserve_paged"
BATCH_KWARG = "tierserve_batch"


@dataclass(slots=True)
class DecodeGroup:
    """Decode rows [start, end) (one token per request), gathered and padded together.

    The runner sorts decode rows by context length and groups neighbours, so the padding a
    group's single SDPA call needs stays small while the number of calls stays low.
    """

    start: int
    end: int
    block_ids: torch.Tensor  # [(end - start) * max_blocks] long, each row padded with block 0
    context_lens: torch.Tensor  # [end - start] long
    mask: torch.Tensor  # [end - start, 1, 1, max_blocks * block_size] bool (key < context_len)


@dataclass(slots=True)
class PrefillChunk:
    """One request's chunk: rows [start, end), query positions [context_len - (end - start), context_len)."""

    start: int
    end: int
    context_len: int  # tokens of this request with KV after the chunk (prefix + chunk)
    block_ids: torch.Tensor | None  # blocks covering context_len; None when there is no prefix
    positions: torch.Tensor  # [end - start] query positions (for masks)


@dataclass(slots=True)
class ForwardBatch:
    """Per-forward metadata that the attention function reads (built by the model runner)."""

    kv: torch.Tensor  # the pool tensor [num_blocks, L, 2, block_size, H, D]
    # [total_tokens] long: each new token's row of layer 0's K in kv.view(-1, H, D)
    # (block_id * L * 2 * block_size + offset in the block)
    token_rows: torch.Tensor
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    chunks: list[PrefillChunk] = field(default_factory=list)
    # Additive masks by (kind, window, index), built once per forward, shared by the layers.
    _masks: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)

    def decode_mask(self, index: int, window: int | None) -> torch.Tensor:
        """Additive mask [n, 1, 1, keys] of decode group ``index`` (built once per forward)."""
        key = ("decode", window or 0, index)
        mask = self._masks.get(key)
        if mask is None:
            group = self.decode_groups[index]
            allowed = group.mask
            if window is not None:
                pos = torch.arange(allowed.shape[-1], device=allowed.device)
                query_pos = (group.context_lens - 1).view(-1, 1, 1, 1)
                allowed = allowed & (query_pos - pos < window)
            mask = self._additive(allowed)
            self._masks[key] = mask
        return mask

    def chunk_mask(self, index: int, window: int | None) -> torch.Tensor | None:
        """Additive mask [q, k] for chunk ``index`` (None: plain causal, no prefix)."""
        chunk = self.chunks[index]
        num_new = chunk.end - chunk.start
        if chunk.block_ids is None and (window is None or num_new <= window):
            return None
        key = ("chunk", window or 0, index)
        mask = self._masks.get(key)
        if mask is None:
            key_pos = torch.arange(chunk.context_len, device=chunk.positions.device)
            if chunk.block_ids is None:
                key_pos = key_pos[-num_new:]
            delta = chunk.positions.view(-1, 1) - key_pos.view(1, -1)
            allowed = delta >= 0
            if window is not None:
                allowed &= delta < window
            mask = self._additive(allowed)
            self._masks[key] = mask
        return mask

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        # SDPA turns a bool mask into an additive one on every call; do it once per forward.
        mask = torch.zeros(allowed.shape, dtype=self.kv.dtype, device=allowed.device)
        return mask.masked_fill_(~allowed, float("-inf"))


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] -> output [1, T, Hq, D]."""
    batch = kwargs.get(BATCH_KWARG)
    if not isinstance(batch, ForwardBatch):
        raise RuntimeError(
            f"attention {ATTN_IMPLEMENTATION!r} needs the {BATCH_KWARG}= model kwarg "
            "(run the model through engine.runner.ModelRunner)"
        )
    kv = batch.kv
    layer = module.layer_idx
    block_size = kv.shape[3]
    layer_k, layer_v = kv[:, layer, 0], kv[:, layer, 1]  # [num_blocks, block_size, Hkv, D]
    _, num_q_heads, num_tokens, head_dim = query.shape
    num_kv_heads = key.shape[1]
    num_groups = num_q_heads // num_kv_heads

    new_k = key[0].transpose(0, 1)  # [T, Hkv, D]
    new_v = value[0].transpose(0, 1)
    rows = kv.view(-1, num_kv_heads, head_dim)
    k_rows = batch.token_rows + layer * 2 * block_size
    rows.index_copy_(0, k_rows, new_k)
    rows.index_copy_(0, k_rows + block_size, new_v)

    out = query.new_empty(num_tokens, num_q_heads, head_dim)
    for index, group in enumerate(batch.decode_groups):
        n = group.end - group.start
        # Queries grouped by KV head: [n, Hkv, group, D] attend like a `group`-token query.
        q = query[0, :, group.start : group.end].transpose(0, 1).reshape(
            n, num_kv_heads, num_groups, head_dim
        )
        k = layer_k.index_select(0, group.block_ids).view(n, -1, num_kv_heads, head_dim)
        v = layer_v.index_select(0, group.block_ids).view(n, -1, num_kv_heads, head_dim)
        o = F.scaled_dot_product_attention(
            q,
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=batch.decode_mask(index, sliding_window),
            scale=scaling,
        )
        out[group.start : group.end] = o.reshape(n, num_q_heads, head_dim)
    for index, chunk in enumerate(batch.chunks):
        q = query[:, :, chunk.start : chunk.end]
        if chunk.block_ids is None:
            k = key[:, :, chunk.start : chunk.end]
            v = value[:, :, chunk.start : chunk.end]
        else:
            ctx = chunk.context_len
            k = layer_k.index_select(0, chunk.block_ids).view(1, -1, num_kv_heads, head_dim)
            v = layer_v.index_select(0, chunk.block_ids).view(1, -1, num_kv_heads, head_dim)
            k, v = k[:, :ctx].transpose(1, 2), v[:, :ctx].transpose(1, 2)
        mask = batch.chunk_mask(index, sliding_window)
        o = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scaling,
            enable_gqa=num_groups > 1,
        )
        out[chunk.start : chunk.end] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


_registered = False


def register_paged_attention() -> str:
    """Register the attention function with transformers (idempotent); return its name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
        _registered = True
    return ATTN_IMPLEMENTATION
