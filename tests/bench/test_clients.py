"""bench-clients: what each standard client is told. guidellm gets the URL alone (it finds
the model and its tokenizer through /v1/models); aiperf and vllm bench serve get the model
id and /v1/models' root as their tokenizer, so no hub is reached."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.clients import add_arguments, commands

MODEL = {"id": "/models/smollm2", "root": "/models/smollm2-root", "max_model_len": 8192}


def args_for(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["http://127.0.0.1:8000/", *argv])


def test_guidellm_gets_only_the_url(tmp_path: Path) -> None:
    args = args_for()
    argv = commands("guidellm", Path("/venv/bin"), args.url, MODEL, tmp_path, args)
    text = " ".join(argv)
    assert "target=http://127.0.0.1:8000 " in text + " "
    assert MODEL["id"] not in text and MODEL["root"] not in text
    assert f"kind=max_requests,count={args.requests}" in argv


def test_aiperf_and_vllm_get_the_model_and_its_root(tmp_path: Path) -> None:
    args = args_for("--requests", "7", "--concurrency", "3")
    for name in ("aiperf", "vllm"):
        argv = commands(name, Path("/venv/bin"), args.url, MODEL, tmp_path, args)
        assert argv[argv.index("--tokenizer") + 1] == MODEL["root"]
        assert MODEL["id"] in argv and "7" in argv and "3" in argv
        assert "http://127.0.0.1:8000" in argv
