"""One engine step of 8 decodes and a 64-token prefill on SmolLM2-135M (fp32), without and
with a prompt that makes the batch raise (tests/engine/test_step_isolation.PoisonRunner):
the failed batch is rerun one request at a time in the same call. Prints each step's
median time over 5 runs, which request failed and how many tokens the others got:

    PYTHONPATH=. python scripts/step-isolation-delay.py
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.prepare_model import default_model_path
from tests.engine.test_step_isolation import POISON, PoisonRunner

NUM_DECODES = 8


def setup(poisoned: bool) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=str(default_model_path()), dtype="float32",
                                    num_kv_blocks=512, prefill_chunk_size=256))
    engine.runner = PoisonRunner(engine.runner)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i in range(NUM_DECODES):
        engine.add_request(f"d{i}", [100 + i] * 40, params)
    engine.run_plan([], [(f"d{i}", 40) for i in range(NUM_DECODES)])  # now decoding
    engine.add_request("new", [200] * 64, params)
    if poisoned:
        engine.add_request("bad", [POISON] + [201] * 63, params)
    return engine


def step(engine: LLMEngine, poisoned: bool) -> tuple[float, list[str], int]:
    chunks = [("new", 64)] + ([("bad", 64)] if poisoned else [])
    t0 = time.perf_counter()
    outs, _ = engine.run_plan([f"d{i}" for i in range(NUM_DECODES)], chunks)
    seconds = time.perf_counter() - t0
    return (seconds, [o.req_id for o in outs if o.error],
            sum(len(o.new_token_ids) for o in outs))


def main() -> None:
    torch.set_num_threads(1)
    for poisoned in (False, True):
        times = []
        for _ in range(5):
            step(setup(poisoned), poisoned)  # warm-up
            seconds, failed, tokens = step(setup(poisoned), poisoned)
            times.append(seconds)
        print(f"{'with' if poisoned else 'without'} a failing prompt: median step "
              f"{statistics.median(times) * 1000:.0f} ms, failed {failed}, "
              f"tokens to the others {tokens}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
