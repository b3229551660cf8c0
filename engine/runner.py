"""Turns one scheduled batch into one model forward and returns the logits to sample.

Input: per request, the token ids to run now, their first position, the request's block table
and whether its last position is sampled. Output: logits rows of the sampled requests, in
order. Everything else (which requests, how many tokens) is the engine's business.

The step's metadata (token ids, positions, pool rows, block tables, chunk descriptions) is
built here once per step, as a few tensors, and shared by every layer (engine.attention).
Row order: decodes, then short chunks (``KERNEL_MAX_CHUNK_FLASH`` tokens with the bf16 flash
kernel, else ``KERNEL_MAX_CHUNK``), all attended row by row through the block tables by the
native row kernel, then the longer chunks (the flash kernel, or one SDPA each). Without the
native kernels, decode rows are sorted by context length and grouped (``group_rows``) and
every chunk takes the SDPA path. A layer-major pool (the CUDA path) is attended with
FlexAttention through the block tables (engine.flex_attention), decodes in one batch and
chunks in another; on CUDA, decode-only steps replay captured CUDA graphs
(engine.cuda_graphs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.attention import DecodeGroup, PagedAttention, PrefillChunk, StepMeta
from engine.block_pool import BlockPool
from engine.cuda_graphs import DecodeGraphs
from engine.flex_attention import FlexPagedAttention, FlexStepMeta, build_batch
from engine.forward import LlamaFamilyForward
from engine.kernels import NativeKernels, load_kernels

# Chunks up to this many tokens go to the native row kernel with the decodes; longer ones
# to the bf16 flash kernel (faster from ~8 tokens on), or to SDPA (float32, whose blocked
# GEMMs win over the row kernel from ~32 tokens on); engine/README.md has the figures.
KERNEL_MAX_CHUNK = 32
KERNEL_MAX_CHUNK_FLASH = 4


@dataclass(slots=True)
class SeqWork:
    """One request's share of a forward: ``token_ids`` at positions start_pos.. onwards."""

    token_ids: Sequence[int]
    start_pos: int
    block_ids: Sequence[int]  # the request's block table, covering start_pos + len(token_ids)
    sample: bool  # return the logits of the last token


class ModelRunner:
    """Runs packed forwards of ``model`` over ``pool`` with the engine's own forward."""

    def __init__(self, model: torch.nn.Module, pool: BlockPool, *,
                 use_kernel: bool = True) -> None:
        self.model = model
        self.pool = pool
        layout = pool.kv_layout()
        self.device = layout.device
        self.block_size = pool.block_size
        kernel = None
        if use_kernel and self.device.type == "cpu":
            kernel = load_kernels()
            if kernel is not None and not kernel.supports(layout.dtype):
                kernel = None
        self.flash = (kernel is not None and kernel.has_prefill_attention
                      and layout.dtype == torch.bfloat16)
        self.uses_flex = not pool.block_major
        self.attention: PagedAttention | FlexPagedAttention
        if self.uses_flex:
            # compiled where the Triton kernels run; eager (the reference) elsewhere (tests)
            self.attention = FlexPagedAttention(compiled=self.device.type == "cuda")
        else:
            self.attention = PagedAttention(kernel)
        self.forward = LlamaFamilyForward(model, self.attention)
        self.graphs: DecodeGraphs | None = None

    def enable_decode_graphs(self, max_batch: int, max_model_len: int,
                             capture: bool | None = None) -> None:
        """Replay decode-only steps of up to ``max_batch`` requests from CUDA graphs
        (engine.cuda_graphs; captured now). ``capture`` False (tests without a GPU) keeps
        the buffers and buckets but runs the forward on them eagerly."""
        if not self.uses_flex:
            raise ValueError("decode graphs need the flex attention path (a layer-major pool)")
        null = self.pool.null_block
        assert null is not None
        max_blocks = (max_model_len + self.block_size - 1) // self.block_size
        self.graphs = DecodeGraphs(
            self.forward, self.pool.kv_tensor(), null, max_batch, max_blocks,
            capture=self.device.type == "cuda" if capture is None else capture)

    @property
    def uses_kernel(self) -> bool:
        return self.attention.kernel is not None

    @property
    def kernels(self) -> NativeKernels | None:
        return self.attention.kernel

    @torch.inference_mode()
    def execute(self, decodes: Sequence[SeqWork], chunks: Sequence[SeqWork]) -> torch.Tensor:
        """Forward ``decodes`` (one token each) then ``chunks``.

        Returns the logits [num_sampled, vocab] of the works with ``sample`` set, in the order
        given (decodes first, then chunks).
        """
        if self.attention.kernel is not None:
            self.attention.kernel.num_threads = torch.get_num_threads()
        if self.graphs is not None and decodes and not chunks and all(w.sample for w in decodes):
            bs = self.block_size
            tables = [w.block_ids[: w.start_pos // bs + 1] for w in decodes]
            if self.graphs.can_run(len(decodes), max(len(t) for t in tables)):
                return self.graphs.run([w.token_ids[0] for w in decodes],
                                       [w.start_pos for w in decodes], tables)
        if self.uses_flex:
            meta, input_ids, positions, sample_rows = self._flex_step(decodes, chunks)
        elif self.uses_kernel:
            meta, input_ids, positions, sample_rows = self._kernel_step(decodes, chunks)
        else:
            meta, input_ids, positions, sample_rows = self._torch_step(decodes, chunks)
        device = self.device
        ids = torch.tensor(input_ids, dtype=torch.long).to(device)
        keep = None
        if sample_rows != list(range(len(input_ids))):
            keep = torch.tensor(sample_rows, dtype=torch.long).to(device)
        return self.forward(ids, positions.to(device), meta, keep)

    # ---- metadata ----

    def _block_rows(self) -> int:
        """A block's rows in the pool viewed as [num_blocks * L * 2 * bs, H, D]."""
        return self.pool.kv_layout().num_layers * 2 * self.block_size

    def _kernel_step(self, decodes: Sequence[SeqWork], chunks: Sequence[SeqWork]):
        bs = self.block_size
        block_rows = self._block_rows()
        limit = KERNEL_MAX_CHUNK_FLASH if self.flash else KERNEL_MAX_CHUNK
        short = [i for i, w in enumerate(chunks) if len(w.token_ids) <= limit]
        long = [i for i, w in enumerate(chunks) if len(w.token_ids) > limit]
        input_ids: list[int] = [w.token_ids[0] for w in decodes]
        pos_list: list[int] = [w.start_pos for w in decodes]
        slot_list: list[int] = [
            w.block_ids[w.start_pos // bs] * block_rows + w.start_pos % bs for w in decodes
        ]
        row_seq: list[int] = list(range(len(decodes)))
        tables: list[Sequence[int]] = [w.block_ids[: w.start_pos // bs + 1] for w in decodes]
        chunk_end = [0] * len(chunks)
        for i in short:
            work = chunks[i]
            n = len(work.token_ids)
            first = work.start_pos
            input_ids.extend(work.token_ids)
            pos_list.extend(range(first, first + n))
            table = work.block_ids
            slot_list.extend(table[p // bs] * block_rows + p % bs for p in range(first, first + n))
            row_seq.extend([len(tables)] * n)
            tables.append(table[: (first + n + bs - 1) // bs])
            chunk_end[i] = len(input_ids)
        num_table_rows = len(input_ids)
        positions = [torch.tensor(pos_list, dtype=torch.long)]
        slots = [torch.tensor(slot_list, dtype=torch.long)]
        sdpa_chunks: list[PrefillChunk] = []
        for i in long:
            chunk, pos, rows = self._long_chunk(chunks[i], len(input_ids), block_rows)
            input_ids.extend(chunks[i].token_ids)
            positions.append(pos)
            slots.append(rows)
            sdpa_chunks.append(chunk)
            chunk_end[i] = len(input_ids)
        meta = StepMeta(kv=self.pool.kv_tensor(), slot_rows=torch.cat(slots).to(self.device),
                        num_table_rows=num_table_rows, chunks=sdpa_chunks)
        if num_table_rows:
            width = max(len(t) for t in tables)
            padded = torch.zeros(len(tables), width, dtype=torch.int32)
            for row, table in enumerate(tables):
                padded[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
            meta.block_tables = padded
            meta.row_seq = torch.tensor(row_seq, dtype=torch.int32)
            meta.row_pos = positions[0].to(torch.int32)
        sample_rows = [row for row, w in enumerate(decodes) if w.sample]
        sample_rows.extend(chunk_end[i] - 1 for i, w in enumerate(chunks) if w.sample)
        return meta, input_ids, torch.cat(positions), sample_rows

    def _flex_step(self, decodes: Sequence[SeqWork], chunks: Sequence[SeqWork]):
        """Rows, slots and the (at most two) FlexAttention batches of a layer-major pool."""
        bs = self.block_size
        num_physical = self.pool.num_blocks + 1
        null = self.pool.null_block
        assert null is not None
        input_ids: list[int] = []
        pos_list: list[int] = []
        slot_list: list[int] = []
        batches = []
        sample_rows: list[int] = []
        if decodes:
            tables, q_rows, q_pos = [], [], []
            for row, w in enumerate(decodes):
                p = w.start_pos
                input_ids.append(w.token_ids[0])
                pos_list.append(p)
                slot_list.append(w.block_ids[p // bs] * bs + p % bs)
                tables.append(list(w.block_ids[: p // bs + 1]))
                q_rows.append([row])
                q_pos.append([p])
                if w.sample:
                    sample_rows.append(row)
            batches.append(build_batch(tables, q_rows, q_pos, num_physical, null, self.device))
        if chunks:
            tables, q_rows, q_pos = [], [], []
            for w in chunks:
                first, n = w.start_pos, len(w.token_ids)
                start = len(input_ids)
                input_ids.extend(w.token_ids)
                positions = range(first, first + n)
                pos_list.extend(positions)
                slot_list.extend(w.block_ids[p // bs] * bs + p % bs for p in positions)
                tables.append(list(w.block_ids[: (first + n + bs - 1) // bs]))
                q_rows.append(list(range(start, start + n)))
                q_pos.append(list(positions))
                if w.sample:
                    sample_rows.append(start + n - 1)
            batches.append(build_batch(tables, q_rows, q_pos, num_physical, null, self.device))
        meta = FlexStepMeta(kv=self.pool.kv_tensor(),
                            slot_rows=torch.tensor(slot_list, dtype=torch.long).to(self.device),
                            batches=batches)
        return meta, input_ids, torch.tensor(pos_list, dtype=torch.long), sample_rows

    def _long_chunk(self, work: SeqWork, start: int, block_rows: int
                    ) -> tuple[PrefillChunk, torch.Tensor, torch.Tensor]:
        """A chunk attended with SDPA: its description, positions and pool rows."""
        bs = self.block_size
        n = len(work.token_ids)
        first = work.start_pos
        context_len = first + n
        num_blocks = (context_len + bs - 1) // bs
        table = torch.tensor(list(work.block_ids[:num_blocks]), dtype=torch.long)
        pos = torch.arange(first, context_len)
        rows = table[pos // bs] * block_rows + pos % bs
        chunk = PrefillChunk(
            start=start, end=start + n, context_len=context_len,
            block_ids=table.to(self.device) if first > 0 and not self.flash else None,
            positions=pos.to(self.device),
            block_table=table.to(torch.int32) if self.flash else None,
        )
        return chunk, pos, rows

    def _torch_step(self, decodes: Sequence[SeqWork], chunks: Sequence[SeqWork]):
        bs = self.block_size
        block_rows = self._block_rows()
        device = self.device
        # Decode rows go first, sorted by context length so that groups pad little.
        order = sorted(range(len(decodes)), key=lambda i: decodes[i].start_pos)
        row_of = [0] * len(decodes)
        input_ids: list[int] = []
        pos_list: list[int] = []
        slot_list: list[int] = []
        for row, i in enumerate(order):
            work = decodes[i]
            pos = work.start_pos
            row_of[i] = row
            input_ids.append(work.token_ids[0])
            pos_list.append(pos)
            slot_list.append(work.block_ids[pos // bs] * block_rows + pos % bs)
        sample_rows = [row_of[i] for i, w in enumerate(decodes) if w.sample]
        meta = StepMeta(kv=self.pool.kv_tensor(), slot_rows=torch.empty(0),
                        num_table_rows=len(decodes))
        sorted_blocks = [decodes[i].start_pos // bs + 1 for i in order]
        for first, end in group_rows(sorted_blocks, GROUP_OVERHEAD_BLOCKS):
            max_blocks = sorted_blocks[end - 1]
            table: list[int] = []
            for row in range(first, end):
                work = decodes[order[row]]
                needed = sorted_blocks[row]
                table.extend(work.block_ids[:needed])
                table.extend([0] * (max_blocks - needed))
            context_lens = torch.tensor(
                [decodes[order[row]].start_pos + 1 for row in range(first, end)], dtype=torch.long
            )
            mask = torch.arange(max_blocks * bs).view(1, -1) < context_lens.view(-1, 1)
            meta.decode_groups.append(
                DecodeGroup(
                    start=first,
                    end=end,
                    block_ids=torch.tensor(table, dtype=torch.long).to(device),
                    context_lens=context_lens.to(device),
                    mask=mask.view(end - first, 1, 1, -1).to(device),
                )
            )
        positions = [torch.tensor(pos_list, dtype=torch.long)]
        slots = [torch.tensor(slot_list, dtype=torch.long)]
        for work in chunks:
            chunk, pos, rows = self._long_chunk(work, len(input_ids), block_rows)
            input_ids.extend(work.token_ids)
            positions.append(pos)
            slots.append(rows)
            meta.chunks.append(chunk)
            if work.sample:
                sample_rows.append(len(input_ids) - 1)
        meta.slot_rows = torch.cat(slots).to(device)
        return meta, input_ids, torch.cat(positions), sample_rows


# A group's fixed cost (one gather + one SDPA call per layer) in blocks of padded KV.
GROUP_OVERHEAD_BLOCKS = 8


def group_rows(sorted_blocks: Sequence[int], overhead: int) -> list[tuple[int, int]]:
    """Split rows sorted by block count into [first, end) groups of least padded cost.

    Cost of a group = overhead + rows * its largest block count; exact dynamic programming
    over contiguous groups (rows <= max_num_seqs, so O(n^2) is cheap).
    """
    n = len(sorted_blocks)
    if n == 0:
        return []
    best = [0] * (n + 1)
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        width = sorted_blocks[end - 1]
        best_cost = -1
        for first in range(end):
            cost = best[first] + overhead + (end - first) * width
            if best_cost < 0 or cost < best_cost:
                best_cost, cut[end] = cost, first
        best[end] = best_cost
    groups: list[tuple[int, int]] = []
    end = n
    while end > 0:
        groups.append((cut[end], end))
        end = cut[end]
    groups.reverse()
    return groups
