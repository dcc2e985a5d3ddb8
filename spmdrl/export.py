"""Export a checkpoint's actor as a Hugging Face folder (safetensors, config, tokenizer, generation config).

    python -m spmdrl.export --checkpoint outputs/spmdrl/grpo_tiny/checkpoints/global_step_100 --out hf_model
    python -m spmdrl.export --checkpoint outputs/spmdrl/grpo_tiny --out hf_model   # its newest checkpoint

Runs in one plain process (no torchrun): torch.distributed.checkpoint loads the
sharded actor, whatever world size saved it, into a Hugging Face model built
from the checkpoint's ``model_files/config.json``. The weights are written as
safetensors, split into ``model-0000i-of-0000n.safetensors`` with a
``model.safetensors.index.json`` when larger than ``--max-shard-size``; a tied
``lm_head.weight`` is left out, as ``save_pretrained`` does. Nothing here
writes or reads pickle. ``trainer.export_hf_on_save`` writes the same folder
from the live engine (``write_hf_folder``) at each save.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch

from spmdrl.cli import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
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

    for name, tensor in weights:
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
    for f in model_files.iterdir():
        if f.is_file() and f.name != "config.json":
            shutil.copyfile(f, out / f.name)
    if dtype is not None:
        config["torch_dtype" if "torch_dtype" in config else "dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out


def read_model_state(checkpoint: Path, role: str = "actor") -> dict[str, torch.Tensor]:
    """Full tensors of a checkpoint's model under HF names, loaded in this process (no process group)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from spmdrl.checkpoint import load_state, verify_checkpoint

    manifest = verify_checkpoint(checkpoint)
    if role != "actor" or "actor" not in manifest["roles"]:
        raise ConfigError(f"checkpoint {str(checkpoint)!r} has no {role} that exports as a causal LM; "
                          f"use actor")
    config = AutoConfig.from_pretrained(checkpoint / manifest["model_files"])
    # Real (not meta) tensors: DCP copies the saved shards into them in place.
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[manifest["dtype"]])
    state = {k: v for k, v in model.state_dict().items()}
    if sorted(state) != sorted(manifest["model_shapes"][role]):
        missing = sorted(set(state) ^ set(manifest["model_shapes"][role]))
        raise ConfigError(f"checkpoint {str(checkpoint)!r} does not match its config.json "
                          f"(weights {missing[:3]})")
    load_state({"model": state}, checkpoint / role)
    return state


def export_checkpoint(
    checkpoint: Path, out: Path, max_shard_size: int = parse_size(DEFAULT_SHARD), dtype: Optional[str] = None
) -> Path:
    """``checkpoint`` (``global_step_N``, or a run/checkpoints folder: its newest) -> HF folder ``out``."""
    from spmdrl.checkpoint import read_manifest, resolve_resume

    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {str(out)!r} exists and is not empty; choose a new folder")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not valid; valid: {', '.join(DTYPES)}")
    path = resolve_resume(str(checkpoint), Path("."))
    state = read_model_state(path)
    files = path / read_manifest(path)["model_files"]
    if out.exists():
        out.rmdir()
    # Into a temporary sibling first, so an interrupted export never looks like a finished folder.
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    write_hf_folder(state.items(), tmp, files, max_shard_size, DTYPES[dtype] if dtype else None)
    os.rename(tmp, out)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m spmdrl.export", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, type=Path,
                   help="global_step_N folder, or a run or checkpoints folder (its newest checkpoint)")
    p.add_argument("--out", required=True, type=Path,
                   help="Hugging Face folder to create (must not exist or be empty)")
    p.add_argument("--max-shard-size", default=DEFAULT_SHARD,
                   help="largest safetensors file, e.g. 5GB or 500MB")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="cast weights (default: as trained)")
    args = p.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out, parse_size(args.max_shard_size), args.dtype)
    except ConfigError as err:
        print(f"spmdrl.export: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
