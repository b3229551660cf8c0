"""Attention over block tables, for the engine's forward (engine.forward).

One forward runs one packed step: every scheduled token of every request, flattened into
``[total_tokens]`` rows. The runner orders the rows and describes them once per step in a
:class:`StepMeta`:

    rows [0, num_table_rows)        "table rows": decodes first, then short prefill chunks;
                                    each row attends to its own sequence's keys 0..pos
                                    read through the block table
    rows [num_table_rows, total)    long prefill chunks (PrefillChunk): the native bf16
                                    flash kernel where it runs, else one SDPA each

Per layer, :meth:`PagedAttention.forward`:

1. writes the new K and V into the pool, viewed as rows ``[num_blocks * L * 2 * block_size,
   H, D]`` (block-major, see engine.block_pool): a token's row for layer ``l`` is its
   ``slot_rows`` entry (layer 0's K) plus ``l * 2 * block_size`` (K) or ``block_size`` more (V);
2. table rows: the native kernel (engine.kernels) reads K and V in place through the block
   tables, with no gather, padding or mask. Where the kernel cannot be built, decode rows
   go through the torch path instead: rows sorted by context length in a few groups, each
   group's blocks gathered with one ``index_select`` and attended with one masked SDPA;
3. each long chunk: attends causally to its own tokens and to the request's cached prefix.
   bf16 with the native kernels: the flash kernel reads them through the block table
   (``PrefillChunk.block_table``). Otherwise SDPA: the prefix is gathered from its blocks;
   a chunk with no prefix attends to its own K/V directly, in the same SDPA call
   transformers makes (float32 stays token-identical to ``generate``).

Sliding-window layers (Mistral, some Qwen2) get the window in the kernel and in the masks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.kernels import NativeKernels


@dataclass(slots=True)
class DecodeGroup:
    """Decode rows [start, end) for the torch path, gathered and padded together.

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
    # the flash kernel's int32 block table (covering context_len); None: the SDPA path
    block_table: torch.Tensor | None = None


@dataclass(slots=True)
class StepMeta:
    """Per-step metadata the attention reads (built once per step by the model runner)."""

    kv: torch.Tensor  # the pool tensor [num_blocks, L, 2, block_size, H, D]
    # [total_tokens] long: each new token's row of layer 0's K in kv.view(-1, H, D)
    # (block_id * L * 2 * block_size + offset in the block)
    slot_rows: torch.Tensor
    num_table_rows: int = 0
    # kernel path: [num_seqs, max_blocks] int32 block tables; per table row its sequence
    # (a row of block_tables) and its position, int32
    block_tables: torch.Tensor | None = None
    row_seq: torch.Tensor | None = None
    row_pos: torch.Tensor | None = None
    decode_groups: list[DecodeGroup] = field(default_factory=list)  # torch path
    chunks: list[PrefillChunk] = field(default_factory=list)
    # Additive masks by (kind, window, index), built once per step, shared by the layers.
    _masks: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)

    def decode_mask(self, index: int, window: int | None) -> torch.Tensor:
        """Additive mask [n, 1, 1, keys] of decode group ``index`` (built once per step)."""
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
        # SDPA turns a bool mask into an additive one on every call; do it once per step.
        mask = torch.zeros(allowed.shape, dtype=self.kv.dtype, device=allowed.device)
        return mask.masked_fill_(~allowed, float("-inf"))


class PagedAttention:
    """The attention of every layer: K/V into the pool, then table rows and long chunks."""

    def __init__(self, kernel: NativeKernels | None) -> None:
        self.kernel = kernel

    def forward(
        self,
        layer: int,
        query: torch.Tensor,  # [T, Hq, D] (rotary applied; each row's heads contiguous)
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        meta: StepMeta,
        sliding_window: int | None,
        scale: float,
        kv_written: bool = False,
    ) -> torch.Tensor:
        """The attention output [T, Hq * D] (``kv_written``: the caller already put this
        step's K and V into the pool, as the fused rotary kernel does)."""
        kv = meta.kv
        block_size = kv.shape[3]
        num_tokens, num_q_heads, head_dim = query.shape
        num_kv_heads = key.shape[1]
        num_groups = num_q_heads // num_kv_heads

        if not kv_written:
            rows = kv.view(-1, num_kv_heads, head_dim)
            k_rows = meta.slot_rows + layer * 2 * block_size
            rows.index_copy_(0, k_rows, key)
            rows.index_copy_(0, k_rows + block_size, value)

        out = query.new_empty(num_tokens, num_q_heads, head_dim)
        num_table = meta.num_table_rows
        if num_table and meta.block_tables is not None and self.kernel is not None:
            self.kernel.attend(query[:num_table], kv, layer, meta.block_tables, meta.row_seq,
                               meta.row_pos, sliding_window, scale, out[:num_table])
        elif num_table:
            self._decode_groups(layer, query, meta, sliding_window, scale, out)
        layer_k, layer_v = kv[:, layer, 0], kv[:, layer, 1]  # [num_blocks, block_size, Hkv, D]
        for index, chunk in enumerate(meta.chunks):
            if chunk.block_table is not None and self.kernel is not None:
                first_pos = chunk.context_len - (chunk.end - chunk.start)
                if self.kernel.prefill_attend(query[chunk.start : chunk.end], kv, layer,
                                              chunk.block_table, first_pos, sliding_window,
                                              scale, out[chunk.start : chunk.end]):
                    continue
                if chunk.context_len > chunk.end - chunk.start:  # declined (head_dim): SDPA
                    chunk.block_ids = chunk.block_table.long()
            q = query[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
            if chunk.block_ids is None:
                k = key[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
                v = value[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
            else:
                ctx = chunk.context_len
                k = layer_k.index_select(0, chunk.block_ids).view(1, -1, num_kv_heads, head_dim)
                v = layer_v.index_select(0, chunk.block_ids).view(1, -1, num_kv_heads, head_dim)
                k, v = k[:, :ctx].transpose(1, 2), v[:, :ctx].transpose(1, 2)
            mask = meta.chunk_mask(index, sliding_window)
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                enable_gqa=num_groups > 1,
            )
            out[chunk.start : chunk.end] = o[0].transpose(0, 1)
        return out.view(num_tokens, num_q_heads * head_dim)

    @staticmethod
    def _decode_groups(layer: int, query: torch.Tensor, meta: StepMeta,
                       sliding_window: int | None, scale: float, out: torch.Tensor) -> None:
        kv = meta.kv
        _, num_q_heads, head_dim = query.shape
        num_kv_heads = kv.shape[4]
        num_groups = num_q_heads // num_kv_heads
        layer_k, layer_v = kv[:, layer, 0], kv[:, layer, 1]
        for index, group in enumerate(meta.decode_groups):
            n = group.end - group.start
            # Queries grouped by KV head: [n, Hkv, group, D] attend like a `group`-token query.
            q = query[group.start : group.end].reshape(n, num_kv_heads, num_groups, head_dim)
            k = layer_k.index_select(0, group.block_ids).view(n, -1, num_kv_heads, head_dim)
            v = layer_v.index_select(0, group.block_ids).view(n, -1, num_kv_heads, head_dim)
            o = F.scaled_dot_product_attention(
                q, k.transpose(1, 2), v.transpose(1, 2),
                attn_mask=meta.decode_mask(index, sliding_window), scale=scale,
            )
            out[group.start : group.end] = o.reshape(n, num_q_heads, head_dim)
