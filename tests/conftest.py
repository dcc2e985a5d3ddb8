"""Shared pytest fixtures and hooks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

MULTIPROC = Path(__file__).parent / "multiproc"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny Qwen2 folder (random weights, local BPE tokenizer), built once per test session."""
    from spmdrl.builtin.models import build_model

    return build_model(tmp_path_factory.mktemp("tiny_model") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="session")
def untied_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its own LM head (the embedding plus noise) instead of the tied one."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                 tie_word_embeddings=False)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        noise = torch.randn(embed.shape, generator=torch.Generator().manual_seed(4))
        model.lm_head.weight.copy_(embed + 0.02 * noise)
    out = tmp_path_factory.mktemp("untied") / "tiny_untied"
    model.save_pretrained(out)
    return out


@pytest.fixture(autouse=True)
def _seeded_torch() -> None:
    """Every test starts from the same global torch seed, so a result never depends on test order or luck."""
    import torch

    torch.manual_seed(0)


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """The multi-process tier's ranks (tests/multiproc/dist_utils.py) stay up across its tests and end with
    it, not with the session, so that the tests after it have the memory back. (A hook here rather than in
    a tests/multiproc/conftest.py, which would shadow tests/e2e's conftest module for ``from conftest``.)"""
    leaving = nextitem is None or MULTIPROC not in Path(nextitem.path).parents
    dist_utils = sys.modules.get("dist_utils")  # imported by the tier's modules
    if MULTIPROC in Path(item.path).parents and leaving and dist_utils is not None:
        dist_utils.close_all()
