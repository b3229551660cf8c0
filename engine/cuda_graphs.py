"""Decode-only steps replayed from CUDA graphs, one per padded batch size.

Why: a decode step of a small model on a GPU is hundreds of short kernels, and launching them
from Python costs more than running them (vLLM and SGLang capture decode steps the same
way). A graph replays a fixed sequence of kernels on fixed addresses, so every input lives in
a static buffer that is filled before each replay:

    per step (host)      token ids, positions, KV slots, block tables, block counts of the
                         n decodes, padded to the bucket size b >= n (padding rows: token 0
                         at position 0 in the pool's null block, which no request owns)
    captured (device)    the FlexAttention metadata from those tables (engine.flex_attention.
                         fill_batch), then the whole forward: embedding, every layer (K/V
                         written into the pool, paged FlexAttention), final norm, LM head
    after replay         logits[:n] go to the sampler (outside the graph)

Buckets: 1, 2, 4, 8, then multiples of 8 up to ``max_batch`` (vLLM's capture sizes). A
step with more decodes, or with prefill chunks, runs eagerly. Graphs are captured at
start, largest first, sharing one memory pool.

``capture=False`` keeps every buffer and the bucket logic but calls the forward on the
static buffers instead of replaying a graph: how the plumbing is tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.flex_attention import FlexBatch, FlexStepMeta, fill_batch, make_batch_buffers


def bucket_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4) if b <= max_batch]
    sizes.extend(range(8, max_batch + 1, 8))
    if max_batch not in sizes:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    """Captured decode steps of one runner (see the module docstring)."""

    def __init__(self, forward: Callable, kv: torch.Tensor, null_block: int,
                 max_batch: int, max_blocks_per_seq: int, *, capture: bool = True) -> None:
        self.forward = forward
        self.kv = kv
        self.null_block = null_block
        self.block_size = int(kv.shape[3])
        self.sizes = bucket_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_blocks = max_blocks_per_seq
        self.capture = capture
        device = kv.device
        b = self.max_batch
        self.input_ids = torch.zeros(b, dtype=torch.long, device=device)
        self.positions = torch.zeros(b, dtype=torch.long, device=device)
        self.slot_rows = torch.zeros(b, dtype=torch.long, device=device)
        self.tables = torch.zeros(b, self.max_blocks, dtype=torch.long, device=device)
        self.counts = torch.zeros(b, dtype=torch.int32, device=device)
        self.batch = make_batch_buffers(b, 1, int(kv.shape[2]), device)
        self.rows = torch.arange(b, device=device).view(b, 1)
        # host staging, pinned so the copies to the device do not sync
        pin = device.type == "cuda"
        self._host = {
            "ids": torch.zeros(b, dtype=torch.long, pin_memory=pin),
            "pos": torch.zeros(b, dtype=torch.long, pin_memory=pin),
            "slot": torch.zeros(b, dtype=torch.long, pin_memory=pin),
            "tables": torch.zeros(b, self.max_blocks, dtype=torch.long, pin_memory=pin),
            "counts": torch.zeros(b, dtype=torch.int32, pin_memory=pin),
        }
        self._steps: dict[int, Callable[[], torch.Tensor]] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_runs = 0  # steps served from the buffers (observability, tests)
        for size in sorted(self.sizes, reverse=True):
            self._prepare(size)

    def can_run(self, num_decodes: int, max_blocks: int) -> bool:
        return 0 < num_decodes <= self.max_batch and max_blocks <= self.max_blocks

    def _bucket(self, n: int) -> int:
        return next(size for size in self.sizes if size >= n)

    def _views(self, b: int) -> FlexBatch:
        full = self.batch
        return FlexBatch(q_rows=full.q_rows[:b], q_pos=full.q_pos[:b],
                         kv_num_blocks=full.kv_num_blocks[:b], kv_indices=full.kv_indices[:b],
                         logical=full.logical[:b])

    def _prepare(self, b: int) -> None:
        batch = self._views(b)
        meta = FlexStepMeta(kv=self.kv, slot_rows=self.slot_rows[:b], batches=[batch])

        def step() -> torch.Tensor:
            fill_batch(batch, self.rows[:b], self.positions[:b].view(b, 1).to(torch.int32),
                       self.tables[:b], self.counts[:b])
            return self.forward(self.input_ids[:b], self.positions[:b], meta, None)

        self._steps[b] = step
        if not self.capture:
            return
        self._pad_all(b)
        stream = torch.cuda.Stream(device=self.kv.device)
        stream.wait_stream(torch.cuda.current_stream(self.kv.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compiles FlexAttention for this shape, outside the capture
                step()
        torch.cuda.current_stream(self.kv.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if not hasattr(self, "_pool"):
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            self._outputs[b] = step()
        self._graphs[b] = graph

    def _pad_all(self, b: int) -> None:
        """Every row of bucket ``b`` a padding row (null block), for warm-up and capture."""
        host = self._host
        host["ids"].zero_()
        host["pos"].zero_()
        host["slot"].fill_(self.null_block * self.block_size)
        host["tables"].fill_(self.null_block)
        host["counts"].fill_(1)
        self._upload(b)

    def _upload(self, b: int) -> None:
        host = self._host
        for name, dest in (("ids", self.input_ids), ("pos", self.positions),
                           ("slot", self.slot_rows), ("tables", self.tables),
                           ("counts", self.counts)):
            dest[:b].copy_(host[name][:b], non_blocking=True)

    def run(self, token_ids: Sequence[int], positions: Sequence[int],
            tables: Sequence[Sequence[int]]) -> torch.Tensor:
        """Logits [n, vocab] of n decodes (``tables``: each one's blocks up to its position)."""
        n = len(token_ids)
        b = self._bucket(n)
        bs = self.block_size
        host = self._host
        ids, pos, slot = host["ids"], host["pos"], host["slot"]
        table, counts = host["tables"], host["counts"]
        table[:b].fill_(self.null_block)
        for i in range(n):
            p = int(positions[i])
            blocks = tables[i]
            ids[i] = int(token_ids[i])
            pos[i] = p
            slot[i] = blocks[p // bs] * bs + p % bs
            table[i, : len(blocks)] = torch.as_tensor(blocks, dtype=torch.long)
            counts[i] = len(blocks)
        ids[n:b] = 0
        pos[n:b] = 0
        slot[n:b] = self.null_block * bs
        counts[n:b] = 1
        self._upload(b)
        self.num_runs += 1
        if self.capture:
            self._graphs[b].replay()
            return self._outputs[b][:n]
        return self._steps[b]()[:n]
