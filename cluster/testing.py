"""Helpers for tests and benchmarks of a running cluster (no fakes: real model, real Ray).

``free_port()`` picks a loopback port; ``greedy_reference`` runs transformers' own
``generate`` on a checkpoint for token-identity checks; ``wait_until`` polls a condition
with a deadline (tests assert the condition, never the time it took).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def greedy_reference(model_path: str | Path, prompt_ids: Sequence[int], max_new_tokens: int
                     ) -> list[int]:
    """transformers' greedy ``generate`` (fp32, CPU): the new token ids, EOS included."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    model.eval()
    ids = torch.tensor([list(prompt_ids)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens)
    return [int(t) for t in out[0, ids.shape[1]:]]


def wait_until(cond: Callable[[], bool], timeout_s: float = 30.0, interval_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval_s)
    return cond()
