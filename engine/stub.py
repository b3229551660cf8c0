"""An engine with every part but the model: for measuring the control plane alone.

:func:`make_stub_engine` builds a real :class:`~engine.engine.LLMEngine` (its block pool,
scheduling, prefix cache, stop conditions, ``run_plan``) over a one-layer placeholder
model whose forward costs nothing: the runner returns zero logits, so greedy sampling
picks token 0 every step. A cluster over stub engines spends its time only in the router,
the global scheduler, the workers' Python and Ray, which is what ``tierserve
bench-control`` measures (requests per second through router and scheduler). Selected
with ``model.path: stub`` in ``pools.mode: aggregated`` (it has no KV to transfer).

A *paced* stub (``model.stub_step_s``, ``model.stub_token_s``) sleeps in each step for
the time a model would take (a fixed cost plus a cost per token computed), with the
GIL released: each worker then has a capacity of its own, set by that pace and not by
the host's cores, so a bench can show what adding or removing workers does (``tierserve
bench-scale``) on a laptop.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine

STUB_VOCAB = 512
STUB_CONTEXT = 8192


class _StubConfig:
    num_hidden_layers = 1
    num_attention_heads = 1
    num_key_value_heads = 1
    hidden_size = 8
    head_dim = 8
    vocab_size = STUB_VOCAB
    max_position_embeddings = STUB_CONTEXT
    eos_token_id = None


class _StubModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = _StubConfig()
        self.generation_config = None
        self.anchor = torch.nn.Parameter(torch.zeros(1), requires_grad=False)


class _StubRunner:
    """Zero logits for every sampled row: no forward at all (and no native kernels);
    paced, it first sleeps ``step_s`` plus ``token_s`` per token the step computes."""

    kernels = None

    def __init__(self, step_s: float = 0.0, token_s: float = 0.0) -> None:
        if step_s < 0 or token_s < 0:
            raise ValueError("a stub's pace must be >= 0 seconds")
        self.step_s, self.token_s = step_s, token_s

    def execute(self, decodes: Sequence[object], chunks: Sequence[object]) -> torch.Tensor:
        n = sum(len(w.token_ids) if getattr(w, "all_logits", False) else 1
                for w in (*decodes, *chunks) if getattr(w, "sample", False)
                or getattr(w, "all_logits", False))
        if self.step_s or self.token_s:
            tokens = len(decodes) + sum(len(getattr(c, "token_ids", ())) for c in chunks)
            time.sleep(self.step_s + self.token_s * tokens)
        return torch.zeros(n, STUB_VOCAB)


def make_stub_engine(num_kv_blocks: int, block_size: int = 16, *, max_num_seqs: int = 256,
                     max_num_batched_tokens: int = 8192, step_s: float = 0.0,
                     token_s: float = 0.0) -> LLMEngine:
    cfg = EngineConfig(model="stub", dtype="float32", device="cpu", block_size=block_size,
                       num_kv_blocks=num_kv_blocks, prefill_chunk_size=max_num_batched_tokens,
                       max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
    return LLMEngine(cfg, model=_StubModel(), tokenizer=None,
                     runner=_StubRunner(step_s, token_s))
