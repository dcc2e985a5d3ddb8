"""The training loop every rank runs (see DESIGN.md, "One step, as every rank sees it")."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from spmdrl.config import Config
from spmdrl.parallel import ParallelDims, device_for_rank
from spmdrl.tools.tiny_model import resolve_builtin_model


def run(cfg: Config, dims: ParallelDims) -> None:
    rank = dist.get_rank()
    device = device_for_rank(dims.device_type)
    model_path = resolve_builtin_model(cfg.model.path)
    summary = _summary(rank, dims, device, model_path)
    print(summary, flush=True)


def _summary(rank: int, dims: ParallelDims, device, model_path: str) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf_cfg).parameters())
    c = dims.coords(rank)
    return (
        f"[rank {rank}/{dims.world_size}] train mesh pp={c['pp']} dp_replicate={c['dp_replicate']} "
        f"dp_shard={c['dp_shard']} tp={c['tp']} | rollout mesh dp={c['rollout_dp']} tp={c['rollout_tp']} | "
        f"device {device} | model {hf_cfg.model_type} {n_params / 1e6:.2f}M params at {model_path}"
    )
