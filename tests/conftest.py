"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


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
