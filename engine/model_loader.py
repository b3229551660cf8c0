"""Loading a local transformers checkpoint onto a device.

The model is an ordinary transformers model (SDPA attention): the engine runs it through its
own forward over the paged pool (engine.forward), which reads the model's weights, and
``model.generate`` still works on it (the tests' reference).
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import resolve_dtype
from engine.errors import UnsupportedArchitecture

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
)
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}


def checkpoint_architecture(path: str | Path) -> str:
    """The checkpoint's architecture name; raises UnsupportedArchitecture if the engine lacks it."""
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no transformers checkpoint at {path} (config.json missing)")
    config = AutoConfig.from_pretrained(path)
    architectures = list(getattr(config, "architectures", None) or [])
    name = architectures[0] if architectures else _MODEL_TYPE_TO_ARCH.get(config.model_type, "")
    if name not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitecture(name or str(config.model_type), SUPPORTED_ARCHITECTURES)
    return name


def load_model(
    path: str | Path, dtype: str = "auto", device: str = "cpu"
) -> tuple[torch.nn.Module, object]:
    """(model in eval mode on ``device``, its tokenizer).

    dtype "auto" is bf16 where the device runs it natively, else fp32.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint_architecture(path)
    torch_device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch_dtype, attn_implementation="sdpa"
    )
    model.to(torch_device).eval()
    model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return model, tokenizer
