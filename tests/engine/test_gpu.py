"""The CUDA path: the same engine code on a cuda device (skipped without a GPU).

On CUDA the engine's default attention is FlexAttention (compiled to Triton) through the
block tables of a layer-major pool, and decode-only steps replay CUDA graphs; ``paged`` is
the block-major torch path (gathered SDPA), kept as the reference and the fallback."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("attention", ["auto", "paged"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_cuda_greedy_matches_generate_and_swap_round_trips(tiny_checkpoints, family,
                                                           attention) -> None:
    path = str(tiny_checkpoints[family])
    engine = LLMEngine(EngineConfig(model=path, dtype="float32", device="cuda",
                                    num_kv_blocks=128, prefill_chunk_size=16,
                                    attention=attention, max_num_seqs=16))
    assert engine.pool.kv_tensor().device.type == "cuda"
    graphs = engine.runner.graphs
    if attention == "auto":  # flex, with captured decode graphs
        assert engine.runner.uses_flex and graphs is not None and graphs.capture
    else:
        assert not engine.runner.uses_flex and graphs is None
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
    if graphs is not None:
        assert graphs.num_runs > 0  # decode steps replayed a captured graph
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


def test_cuda_graph_replays_across_buckets_match_eager(tiny_checkpoints) -> None:
    """Batches of 1 to 11 decodes (buckets 1, 2, 4, 8, 16 with padding rows) replayed from
    graphs give the same greedy tokens as the same engine without graphs."""
    path = str(tiny_checkpoints["llama"])
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist()
               for n in (3, 9, 17, 30, 33, 41, 50, 64, 65, 80, 100)]
    params = SamplingParams(max_tokens=24)
    results = {}
    for max_batch in (16, 0):
        engine = LLMEngine(EngineConfig(model=path, dtype="float32", device="cuda",
                                        num_kv_blocks=256, cuda_graph_max_batch=max_batch))
        outputs = []
        for n in (1, 2, 5, 11):  # one generate per batch size
            outputs.extend(engine.generate(prompts[:n], params))
        if max_batch:
            assert engine.runner.graphs is not None and engine.runner.graphs.num_runs > 0
        else:
            assert engine.runner.graphs is None
        assert engine.num_free_blocks == engine.num_total_blocks
        results[max_batch] = outputs
    assert results[16] == results[0]
