"""The native CPU kernels (engine.kernels) against torch's own ops (skipped where they do not build)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.kernels import load_kernels

KERNELS = load_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="native kernels do not build here")

BF16_ATOL = 2e-2


def reference_attention(q, kv, layer, tables, row_seq, row_pos, window, scale):
    """Row by row: gather the row's keys 0..pos through its table, plain softmax attention."""
    _, _, _, block_size, hkv, d = kv.shape
    hq = q.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32)
    for r in range(q.shape[0]):
        pos = int(row_pos[r])
        table = tables[int(row_seq[r])].long()
        keys = torch.arange(pos + 1)
        if window:
            keys = keys[keys > pos - window]
        k = kv[table[keys // block_size], layer, 0, keys % block_size].float()  # [n, hkv, d]
        v = kv[table[keys // block_size], layer, 1, keys % block_size].float()
        qr = q[r].float().view(hkv, hq // hkv, d)
        scores = torch.einsum("hgd,nhd->hgn", qr, k) * scale
        out[r] = torch.einsum("hgn,nhd->hgd", scores.softmax(-1), v).reshape(hq, d)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 20])
def test_paged_attention_matches_gathered_softmax(dtype, window) -> None:
    g = torch.Generator().manual_seed(0)
    num_blocks, layers, block_size, hkv, d, hq = 40, 3, 16, 2, 64, 6
    kv = torch.randn(num_blocks, layers, 2, block_size, hkv, d, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[:24].view(3, 8).to(torch.int32)
    # decode rows of three sequences, then a 5-token chunk of the second one
    row_seq = torch.tensor([0, 1, 2, 1, 1, 1, 1, 1], dtype=torch.int32)
    row_pos = torch.tensor([0, 40, 127, 60, 61, 62, 63, 64], dtype=torch.int32)
    q = torch.randn(8, hq, d, generator=g).to(dtype)
    out = torch.empty_like(q)
    KERNELS.attend(q, kv, 1, tables, row_seq, row_pos, window, d**-0.5, out)
    expected = reference_attention(q, kv, 1, tables, row_seq, row_pos, window, d**-0.5)
    atol = 1e-5 if dtype == torch.float32 else BF16_ATOL
    assert torch.allclose(out.float(), expected, atol=atol)


@pytest.mark.skipif(KERNELS is None or not KERNELS.has_prefill_attention,
                    reason="no AVX512-BF16 flash kernel here")
@pytest.mark.parametrize("first_pos,num_queries,window", [
    (0, 5, None), (0, 100, None), (37, 70, None), (0, 90, 20), (200, 33, 50),
])
def test_flash_prefill_attention_matches_gathered_softmax(first_pos, num_queries, window) -> None:
    g = torch.Generator().manual_seed(4)
    num_blocks, layers, block_size, hkv, d, hq = 30, 2, 16, 3, 64, 9
    kv = torch.randn(num_blocks, layers, 2, block_size, hkv, d, generator=g).to(torch.bfloat16)
    context = first_pos + num_queries
    table = torch.randperm(num_blocks, generator=g)[: -(-context // block_size)].to(torch.int32)
    q = torch.randn(num_queries, hq, d, generator=g).to(torch.bfloat16)
    out = torch.zeros_like(q)
    assert KERNELS.prefill_attend(q, kv, 1, table, first_pos, window, d**-0.5, out)
    positions = torch.arange(first_pos, context, dtype=torch.int32)
    expected = reference_attention(q, kv, 1, table.view(1, -1), torch.zeros_like(positions),
                                   positions, window, d**-0.5)
    assert torch.allclose(out.float(), expected, atol=BF16_ATOL)


def hf_rms_norm(x, w, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def test_add_rms_norm_is_the_residual_add_then_transformers_norm() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 576, generator=g).to(torch.bfloat16)
    delta = torch.randn(7, 576, generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(576, generator=g)).to(torch.bfloat16)
    summed = x + delta
    expected = hf_rms_norm(summed, w, 1e-5)
    out = KERNELS.add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(x, summed)  # x updated in place
    # the fp32 statistics are summed in another order: at most one bf16 step apart
    assert torch.allclose(out.float(), expected.float(), rtol=8e-3, atol=1e-3)
    assert (out == expected).float().mean() > 0.98
    assert torch.allclose(KERNELS.add_rms_norm(x, None, w, 1e-5).float(), expected.float(),
                          rtol=8e-3, atol=1e-3)


def test_silu_mul_and_rope_store_round_like_torch() -> None:
    g = torch.Generator().manual_seed(2)
    gate_up = (3 * torch.randn(5, 2 * 100, generator=g)).to(torch.bfloat16)
    expected = F.silu(gate_up[:, :100]) * gate_up[:, 100:]
    out = KERNELS.silu_mul(gate_up)
    assert torch.allclose(out.float(), expected.float(), rtol=8e-3, atol=1e-3)
    assert (out == expected).float().mean() > 0.98

    hq, hkv, d, rows, block_size, layers = 3, 1, 64, 4, 16, 2
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, generator=g).to(torch.bfloat16)
    angles = torch.rand(rows, d // 2, generator=g) * 6
    cos = torch.cat([angles.cos()] * 2, -1).to(torch.bfloat16)
    sin = torch.cat([angles.sin()] * 2, -1).to(torch.bfloat16)
    qk = qkv[:, : (hq + hkv) * d].view(rows, hq + hkv, d)
    rotated = torch.cat((-qk[..., d // 2 :], qk[..., : d // 2]), -1)
    expected_qk = qk * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
    expected_v = qkv[:, (hq + hkv) * d :].clone()
    kv = torch.zeros(3, layers, 2, block_size, hkv, d, dtype=torch.bfloat16)
    slots = torch.tensor([0, 5, layers * 2 * block_size + 3, 2 * layers * 2 * block_size + 15])
    KERNELS.rope_store(qkv, hq, hkv, d, cos, sin, kv, slots, 1)
    assert torch.equal(qkv[:, : (hq + hkv) * d].view(rows, hq + hkv, d), expected_qk)
    rows_view = kv.view(-1, hkv, d)
    assert torch.equal(rows_view[slots + 2 * block_size], expected_qk[:, hq:])
    assert torch.equal(rows_view[slots + 3 * block_size], expected_v.view(rows, hkv, d))


def test_argmax_is_the_first_maximum() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 1000, generator=g)
    x[1, 10] = x[1, 900] = 50.0  # a tie: the first wins
    x[2, 999] = 70.0  # in the tail after the vector loop
    x[3, 5] = float("nan")  # NaN counts as the maximum
    assert torch.equal(KERNELS.argmax(x), x.max(dim=-1).indices)
    assert torch.equal(KERNELS.argmax(x[:, :777]), x[:, :777].max(dim=-1).indices)


def test_bf16_engine_with_and_without_kernels_agree(tiny_checkpoints) -> None:
    """The fused bf16 path against torch ops only: the same logits up to bf16 rounding."""
    path = str(tiny_checkpoints["qwen2"])  # biases on q/k/v
    engines = [LLMEngine(EngineConfig(model=path, dtype="bfloat16", num_kv_blocks=64,
                                      native_kernels=native)) for native in (True, False)]
    assert engines[0].runner.forward.fused and not engines[1].runner.forward.fused
    prompt = list(range(40, 90))
    from engine.runner import SeqWork

    logits = []
    for engine in engines:
        blocks = engine.pool.allocate(4)
        # a first chunk, a chunk after that prefix, a 3-token chunk (row kernel), a decode
        first = engine.runner.execute([], [SeqWork(prompt[:24], 0, blocks, sample=False)])
        second = engine.runner.execute([], [SeqWork(prompt[24:40], 24, blocks, sample=True)])
        third = engine.runner.execute([], [SeqWork(prompt[40:43], 40, blocks, sample=True)])
        decode = engine.runner.execute([SeqWork(prompt[43:44], 43, blocks, sample=True)], [])
        assert first.shape[0] == 0
        logits.append(torch.cat([second, third, decode]).float())
    scale = logits[1].abs().max()
    assert (logits[0] - logits[1]).abs().max() < 0.05 * scale
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    same = [engines[0].generate([prompt], greedy)[0], engines[1].generate([prompt], greedy)[0]]
    assert sum(a == b for a, b in zip(*same, strict=True)) >= 6


@pytest.fixture(scope="module")
def portable_kernels(tmp_path_factory):
    """The same sources built for plain x86-64 (no AVX-512): the paths a CPU without it runs."""
    import ctypes
    import shutil
    import subprocess

    from engine.kernels import FLAGS, SOURCES, NativeKernels

    compiler = shutil.which("g++")
    if compiler is None or KERNELS is None:
        pytest.skip("no g++ here")
    target = tmp_path_factory.mktemp("kernels") / "portable.so"
    flags = [f for f in FLAGS if not f.startswith("-march")] + ["-march=x86-64"]
    subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", str(target)], check=True,
                   capture_output=True, timeout=300)
    kernels = NativeKernels(ctypes.CDLL(str(target)))
    assert not kernels.has_prefill_attention
    return kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_portable_build_matches_the_references(portable_kernels, dtype) -> None:
    g = torch.Generator().manual_seed(5)
    kv = torch.randn(20, 2, 2, 16, 2, 64, generator=g).to(dtype)
    tables = torch.randperm(20, generator=g)[:16].view(2, 8).to(torch.int32)
    row_seq = torch.tensor([0, 1, 1], dtype=torch.int32)
    row_pos = torch.tensor([5, 90, 127], dtype=torch.int32)
    q = torch.randn(3, 4, 64, generator=g).to(dtype)
    out = torch.empty_like(q)
    portable_kernels.attend(q, kv, 1, tables, row_seq, row_pos, 30, 0.125, out)
    expected = reference_attention(q, kv, 1, tables, row_seq, row_pos, 30, 0.125)
    assert torch.allclose(out.float(), expected, atol=1e-5 if dtype == torch.float32 else BF16_ATOL)
    x = torch.randn(3, 100, generator=g)
    assert torch.equal(portable_kernels.argmax(x), x.max(dim=-1).indices)
    if dtype == torch.bfloat16:
        h = torch.randn(4, 96, generator=g).to(dtype)
        w = torch.rand(96, generator=g).to(dtype)
        assert torch.allclose(portable_kernels.add_rms_norm(h.clone(), None, w, 1e-6).float(),
                              hf_rms_norm(h, w, 1e-6).float(), rtol=8e-3, atol=1e-3)
        gate_up = torch.randn(3, 2 * 40, generator=g).to(dtype)
        assert torch.allclose(portable_kernels.silu_mul(gate_up).float(),
                              (F.silu(gate_up[:, :40]) * gate_up[:, 40:]).float(),
                              rtol=8e-3, atol=1e-3)
