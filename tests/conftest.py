"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny Qwen2 folder (random weights, local BPE tokenizer), built once per test session."""
    from spmdrl.builtin.models import build_model

    return build_model(tmp_path_factory.mktemp("tiny_model") / "tiny", "tiny", seed=0)


@pytest.fixture(autouse=True)
def _seeded_torch() -> None:
    """Every test starts from the same global torch seed, so a result never depends on test order or luck."""
    import torch

    torch.manual_seed(0)
