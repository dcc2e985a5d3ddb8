"""Export a checkpoint's actor as a Hugging Face folder (safetensors, config, tokenizer, generation config).

    python -m spmdrl.export --checkpoint outputs/spmdrl/grpo_tiny/checkpoints/global_step_100 --out hf_model
    python -m spmdrl.export --checkpoint outputs/spmdrl/grpo_tiny --out hf_model   # its newest checkpoint

A LoRA run's checkpoint holds only its adapters: it exports as a PEFT adapter folder
(``write_adapter_folder``); ``trainer.export_hf_on_save`` writes the merged weights.

Runs in one plain process (no torchrun, no process group). The engine that
saved the actor reads its own folder back as full tensors under HF names,
whatever world size and layout saved it: the manifest names that engine
(``strategies``: fsdp2, megatron) and ``spmdrl.engines.checkpoint_reader``
gives its reader. The weights are written as safetensors, split into
``model-0000i-of-0000n.safetensors`` with a ``model.safetensors.index.json``
when larger than ``--max-shard-size``; a tied ``lm_head.weight`` is left out,
as ``save_pretrained`` does. Nothing here writes or reads pickle.
``trainer.export_hf_on_save`` writes the same folder from the live engine
(``write_hf_folder``) at each save.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from spmdrl.checkpoint.hf_folder import DEFAULT_SHARD, parse_size, write_hf_folder
from spmdrl.checkpoint.layout import read_manifest, resolve_resume, verify_checkpoint
from spmdrl.checkpoint.safe_load import load_model_tensors
from spmdrl.engines import checkpoint_reader
from spmdrl.engines.fsdp2.lora import is_adapter, peft_state, read_adapter_config
from spmdrl.errors import ConfigError
from spmdrl.precision import DTYPES


def read_weights(checkpoint: Path, role: str = "actor") -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` of a checkpoint's model, read in this process by the reader of the engine
    that saved it (a tied ``lm_head.weight`` left out). The checks run now, the loading as it is iterated."""
    manifest = verify_checkpoint(checkpoint)
    if role != "actor" or "actor" not in manifest["roles"]:
        raise ConfigError(f"checkpoint {str(checkpoint)!r} has no {role} that exports as a causal LM; "
                          f"use actor")
    # Manifests from before "strategies" do not name their engine: read them as fsdp2, the only format
    # export read then (it refused Megatron ones).
    strategy = manifest.get("strategies", {}).get(role, "fsdp2")
    try:
        reader = checkpoint_reader(strategy)
    except ValueError as err:
        raise ConfigError(f"checkpoint {str(checkpoint)!r} cannot be exported: {err}") from None
    return reader(checkpoint / role, checkpoint / manifest["model_files"], manifest, role)


def read_model_state(checkpoint: Path, role: str = "actor") -> dict[str, torch.Tensor]:
    """``read_weights`` as one dict of full tensors."""
    return dict(read_weights(checkpoint, role))


def export_checkpoint(
    checkpoint: Path, out: Path, max_shard_size: int = parse_size(DEFAULT_SHARD), dtype: Optional[str] = None
) -> Path:
    """``checkpoint`` (``global_step_N``, or a run/checkpoints folder: its newest) -> HF folder ``out``."""
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {str(out)!r} exists and is not empty; choose a new folder")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not valid; valid: {', '.join(DTYPES)}")
    path = resolve_resume(str(checkpoint), Path("."))
    manifest = read_manifest(path)
    lora = any(is_adapter(n) for n in manifest.get("model_shapes", {}).get("actor", {}))
    weights = None if lora else read_weights(path)
    files = path / manifest["model_files"]
    # Into a temporary sibling first, so an interrupted export never looks like a finished folder.
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        if lora:  # adapters only: the base is the run's model.path
            write_adapter_folder(path, tmp, DTYPES[dtype] if dtype else None)
        else:
            write_hf_folder(weights, tmp, files, max_shard_size, DTYPES[dtype] if dtype else None)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        out.rmdir()
    os.rename(tmp, out)
    return out


def write_adapter_folder(checkpoint: Path, out: Path, dtype: Optional[torch.dtype] = None) -> None:
    """A LoRA run's checkpoint as a PEFT adapter folder (``adapter_model.safetensors``,
    ``adapter_config.json``) for ``PeftModel.from_pretrained`` or vLLM's LoRA: the rank from the tensors,
    lora_alpha and target modules from the run's config, the base from its model.path."""
    import yaml
    from safetensors.torch import save_file

    manifest = verify_checkpoint(checkpoint)
    shapes = {n: s for n, s in manifest["model_shapes"]["actor"].items() if is_adapter(n)}
    tensors = load_model_tensors(checkpoint / "actor", shapes, DTYPES[manifest["dtype"]])
    state = {k: (v.to(dtype) if dtype else v).contiguous()
             for k, v in peft_state(iter(tensors.items())).items()}
    model = (yaml.safe_load((checkpoint / "config.yaml").read_text()) or {}).get("model", {})
    alpha = model.get("lora_alpha", 16)
    if model.get("lora_adapter_path"):  # the run started from this adapter, with its alpha
        alpha = read_adapter_config(model["lora_adapter_path"])["lora_alpha"]
    ranks = {int(v.shape[0]) for k, v in state.items() if ".lora_A." in k}
    modules = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in state})
    out.mkdir(parents=True)
    save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": max(ranks), "lora_alpha": alpha,
              "target_modules": modules, "lora_dropout": 0.0, "bias": "none",
              "base_model_name_or_path": base_model(manifest, model.get("path"))}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1))


def base_model(manifest: dict, configured: Optional[str]) -> Optional[str]:
    """The folder a LoRA run's adapters apply to, as peft loads it: the resolved folder the checkpoint
    records, or (an older checkpoint) the run's model.path with a ``builtin:`` name resolved in the cache and
    a relative path made absolute."""
    if manifest.get("base_model"):
        return manifest["base_model"]
    if configured and configured.startswith("builtin:"):
        from spmdrl.builtin.models import resolve_builtin_model

        return resolve_builtin_model(configured)
    return str(Path(configured).resolve()) if configured else None


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
