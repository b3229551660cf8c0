"""The CUDA path: the same engine code on a cuda device (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_cuda_greedy_matches_generate_and_swap_round_trips(tiny_checkpoints, family) -> None:
    path = str(tiny_checkpoints[family])
    engine = LLMEngine(EngineConfig(model=path, dtype="float32", device="cuda",
                                    num_kv_blocks=128, prefill_chunk_size=16))
    assert engine.pool.kv_tensor().device.type == "cuda"
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 40, 70)]
    params = SamplingParams(max_tokens=16)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    expected = []
    for p in prompts:
        with torch.inference_mode():
            out = ref.generate(torch.tensor([p], device="cuda"), max_new_tokens=16,
                               do_sample=False)
        expected.append(out[0, len(p):].tolist())
    assert engine.generate(prompts, params) == expected
    # Swap a request out to pinned host memory and back: exact round trip.
    engine.add_request("s", prompts[1], SamplingParams(max_tokens=40))
    for _ in range(6):
        engine.step()
    before = engine.pool.read_blocks(engine.block_ids("s")[:3]).cpu()
    assert engine.swap_out("s") and engine.swap_in("s")
    after = engine.pool.read_blocks(engine.block_ids("s")[:3]).cpu()
    assert torch.equal(before, after)
    engine.abort("s")
    assert engine.num_free_blocks == engine.num_total_blocks
