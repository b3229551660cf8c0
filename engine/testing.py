"""Tiny random checkpoints for tests (this package's and others'): no downloads, seconds to build.

``make_tiny_checkpoint(family, directory)`` writes a transformers checkpoint of a 2-layer
Llama / Qwen2 / Mistral model with a fixed seed, plus an offline byte-level tokenizer (256 byte
tokens and three special tokens, a small chat template), and returns the directory. The same
arguments always give the same weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES: tuple[str, ...] = ("llama", "qwen2", "mistral")

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
NUM_BYTE_TOKENS = 256
TINY_VOCAB_SIZE = 259  # 256 bytes + 3 specials: every id decodes
CHAT_TEMPLATE = (
    "{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)


def make_byte_tokenizer():  # -> PreTrainedTokenizerFast
    """A byte-level tokenizer: every byte one token (ids 0..255), then BOS, EOS, PAD."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_to_unicode = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel maps each byte to one printable character; order ids by byte value.
    mapping = _bytes_to_unicode()
    vocab = {mapping[b]: b for b in range(NUM_BYTE_TOKENS)}
    assert set(vocab) <= set(byte_to_unicode)
    for offset, token in enumerate((BOS, EOS, PAD)):
        vocab[token] = NUM_BYTE_TOKENS + offset
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-printable-character table (what tokenizers' ByteLevel uses)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def tiny_config(family: str, **overrides):  # -> PretrainedConfig
    """The config of a tiny model of ``family``; ``overrides`` replace any field."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,  # peaky logits: greedy choices are far from ties
        bos_token_id=NUM_BYTE_TOKENS,
        eos_token_id=NUM_BYTE_TOKENS + 1,
        pad_token_id=NUM_BYTE_TOKENS + 2,
        tie_word_embeddings=False,
    )
    if family == "llama":
        cls = LlamaConfig
    elif family == "qwen2":
        cls = Qwen2Config
    elif family == "mistral":
        cls = MistralConfig
        common["sliding_window"] = 48  # small, so the tests cross the window
    else:
        raise ValueError(f"unknown tiny model family {family!r}; choose one of {FAMILIES}")
    common.update(overrides)
    return cls(**common)


def make_tiny_checkpoint(family: str, directory: str | Path, *, seed: int = 0, **overrides) -> Path:
    """Write a tiny random ``family`` model (fp32 safetensors) and the byte tokenizer; return the dir.

    Idempotent: an existing checkpoint in ``directory`` is kept as is.
    """
    from transformers import AutoModelForCausalLM

    directory = Path(directory)
    if (directory / "config.json").exists() and (directory / "model.safetensors").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    config = tiny_config(family, **overrides)
    fork_devices: list[int] = []
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(directory)
    make_byte_tokenizer().save_pretrained(directory)
    return directory
