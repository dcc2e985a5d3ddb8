"""Write a Hugging Face model folder from a stream of ``(hf_name, full tensor)`` pairs.

Used by ``spmdrl.export`` (from a checkpoint) and by the checkpointer
(``trainer.export_hf_on_save``, from the live engine); a leaf module, so
neither imports the other.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch

from spmdrl.errors import ConfigError

DEFAULT_SHARD = "5GB"


def parse_size(text: str) -> int:
    """Bytes of "5GB", "500MB", "64KiB" or a plain integer (decimal units as HF uses, binary with "i")."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise ConfigError(f"--max-shard-size {text!r} is not a size; write e.g. 5GB, 500MB or 1000000")
    number, unit, binary = m.groups()
    base = 1024 if binary else 1000
    return int(float(number) * base ** "_KMGT".index(unit.upper() or "_"))


def write_hf_folder(
    weights: Iterable[tuple[str, torch.Tensor]],
    out: Path,
    model_files: Path,
    max_shard_size: int = parse_size(DEFAULT_SHARD),
    dtype: Optional[torch.dtype] = None,
) -> Path:
    """Write ``(hf_name, full tensor)`` pairs as safetensors shards plus the files of ``model_files``.

    Tensors are held only until their shard is full, so peak memory is about
    one shard. ``dtype`` casts floating tensors (and is written into config.json).
    """
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=False)
    config = json.loads((model_files / "config.json").read_text())
    tied = bool(config.get("tie_word_embeddings", False))
    shards: list[list[str]] = []
    current: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal current, size
        if current:
            save_file(current, str(out / f"part-{len(shards)}.safetensors"), metadata={"format": "pt"})
            shards.append(sorted(current))
            current, size = {}, 0

    for name, tensor in per_expert(weights):  # an MoE model's experts one tensor each, as checkpoints are
        if tied and name == "lm_head.weight":
            continue  # from_pretrained re-ties it to the embedding
        t = tensor.detach().to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_size:
            flush()
        # clone: a 1-rank "full tensor" may be the parameter itself, which must not be shared or change.
        current[name] = t.contiguous().clone()
        size += nbytes
        total += nbytes
    flush()
    if len(shards) == 1:
        os.rename(out / "part-0.safetensors", out / "model.safetensors")
    else:
        weight_map = {}
        for i, names in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            os.rename(out / f"part-{i}.safetensors", out / file)
            weight_map.update({n: file for n in names})
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    for f in model_files.iterdir():  # config, tokenizer, generation config; never another set of weights
        weights = f.name.endswith((".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json"))
        if f.is_file() and f.name != "config.json" and not weights:
            shutil.copyfile(f, out / f.name)
    if dtype is not None:
        config["torch_dtype" if "torch_dtype" in config else "dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out


# transformers 5 keeps a Qwen3-MoE layer's experts in memory as two fused tensors,
# ``mlp.experts.gate_up_proj`` [E, 2I, h] (rows gate | up) and ``mlp.experts.down_proj`` [E, h, I]; its
# checkpoints (what save_pretrained writes and released models ship), and the loaders of vLLM, SGLang and the
# native engine, have one tensor an expert (``mlp.experts.{e}.gate_proj.weight`` ...).
_GATE_UP, _DOWN = ".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"


def per_expert(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs with every fused expert tensor split, as views, into its experts' checkpoint
    names: what every Hugging Face folder spmdrl writes holds, and what the native engine loads."""
    for name, t in named:
        if name.endswith(_GATE_UP):  # [E, 2I, h]
            prefix, inner = name[: -len(_GATE_UP)], t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{prefix}.mlp.experts.{e}.gate_proj.weight", t[e, :inner]
                yield f"{prefix}.mlp.experts.{e}.up_proj.weight", t[e, inner:]
        elif name.endswith(_DOWN):  # [E, h, I]
            prefix = name[: -len(_DOWN)]
            for e in range(t.shape[0]):
                yield f"{prefix}.mlp.experts.{e}.down_proj.weight", t[e]
        else:
            yield name, t
