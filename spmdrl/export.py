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
import os
import shutil
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from spmdrl.checkpoint.manager import load_state, read_manifest, resolve_resume, verify_checkpoint
from spmdrl.errors import ConfigError
from spmdrl.checkpoint.hf_folder import DEFAULT_SHARD, parse_size, write_hf_folder
from spmdrl.precision import DTYPES
def read_model_state(checkpoint: Path, role: str = "actor") -> dict[str, torch.Tensor]:
    """Full tensors of a checkpoint's model under HF names, loaded in this process (no process group)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    manifest = verify_checkpoint(checkpoint)
    if role != "actor" or "actor" not in manifest["roles"]:
        raise ConfigError(f"checkpoint {str(checkpoint)!r} has no {role} that exports as a causal LM; "
                          f"use actor")
    saved_cfg = checkpoint / "config.yaml"
    if saved_cfg.is_file() and "strategy: megatron" in saved_cfg.read_text():
        raise ConfigError(f"checkpoint {str(checkpoint)!r} holds Megatron shards (actor.strategy megatron), which "
                          f"this export does not convert; train with trainer.export_hf_on_save true, which writes "
                          f"a Hugging Face folder global_step_N/hf/ at each save")
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
