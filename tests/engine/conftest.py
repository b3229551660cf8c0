"""Shared fixtures: tiny random checkpoints of the three families, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.testing import FAMILIES, make_tiny_checkpoint

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {family: make_tiny_checkpoint(family, root / family) for family in FAMILIES}
