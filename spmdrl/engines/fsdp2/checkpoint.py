"""An FSDP2 engine's checkpoint folder read back as Hugging Face tensors, in one plain process.

The engine saves ``get_model_state_dict`` of its HF model with torch.distributed.checkpoint, so the
``model`` keys are already the HF state-dict names and the manifest's shapes are the full (global)
ones: whatever world size and mesh saved the folder, the reader loads it a decoder layer at a time.

    for name, tensor in read_checkpoint(step_dir / "actor", step_dir / "model_files", manifest, "actor"): ...
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Iterator

import torch

from spmdrl.checkpoint.safe_load import load_model_tensors
from spmdrl.errors import ConfigError
from spmdrl.precision import DTYPES

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _layer(name: str) -> int:
    """Decoder layer of an HF weight name; -1 for the weights outside the layers."""
    return int(m.group(1)) if (m := _LAYER.match(name)) else -1


def _hf_model_names(model_files: Path) -> tuple[list[str], bool]:
    """State-dict names of the causal LM ``model_files/config.json`` describes, in the model's order, and
    whether its head is tied (built on the meta device: no weights are allocated)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_files)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return list(model.state_dict()), bool(getattr(config, "tie_word_embeddings", False))


def read_checkpoint(folder: Path, model_files: Path, manifest: dict,
                    role: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` of the causal LM ``role`` saved in ``folder`` (``global_step_N/{role}``), in
    the HF model's order, one decoder layer in memory at a time; a tied ``lm_head.weight`` is left out, as
    ``FSDP2Engine.export_weights`` does. Needs no process group."""
    saved = manifest["model_shapes"][role]
    names, tied = _hf_model_names(model_files)
    if sorted(names) != sorted(saved):
        different = sorted(set(names) ^ set(saved))
        raise ConfigError(f"checkpoint {str(folder.parent)!r} does not match its config.json "
                          f"(weights {different[:3]})")
    wanted = [n for n in names if not (tied and n == "lm_head.weight")]
    dtype = DTYPES[manifest["dtype"]]
    for _, group in itertools.groupby(wanted, key=_layer):
        yield from load_model_tensors(folder, {n: saved[n] for n in group}, dtype).items()
