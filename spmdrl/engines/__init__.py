"""Training engines, built by name so a run only imports the backend it uses.

    from spmdrl.engines import build_engine
    actor = build_engine(cfg, model_path, role="actor", dims=dims, device=device, total_steps=100)

``cfg.actor.strategy`` picks the backend: ``fsdp2`` (``spmdrl.engines.fsdp2.FSDP2Engine``)
runs on CPU and GPU; ``megatron`` needs CUDA and megatron-core.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Literal

import torch

from spmdrl.engines.base import LossFn, LossScale, TrainEngine

if TYPE_CHECKING:
    from spmdrl.config import Config
    from spmdrl.parallel import ParallelDims

# strategy name -> "module:class"; imported only when that strategy is built.
ENGINES: dict[str, str] = {
    "fsdp2": "spmdrl.engines.fsdp2:FSDP2Engine",
    "megatron": "spmdrl.engines.megatron:MegatronEngine",
}


def engine_class(strategy: str) -> type[TrainEngine]:
    """The engine class of ``strategy`` (``actor.strategy`` in the config), imported on demand."""
    if strategy not in ENGINES:
        raise ValueError(
            f"unknown training strategy {strategy!r} (actor.strategy); valid: {', '.join(ENGINES)}"
        )
    if strategy == "megatron" and (
        not torch.cuda.is_available() or importlib.util.find_spec("megatron") is None
    ):
        raise ValueError(
            "actor.strategy='megatron' needs a CUDA GPU with megatron-core installed "
            "(pip install 'spmdrl[megatron]'); use actor.strategy='fsdp2' on this machine"
        )
    module, cls = ENGINES[strategy].split(":")
    return getattr(importlib.import_module(module), cls)


def build_engine(
    cfg: "Config",
    model_path: str,
    *,
    role: Literal["actor", "ref", "critic"],
    dims: "ParallelDims",
    device: torch.device,
    total_steps: int | None = None,
) -> TrainEngine:
    """The ``role`` engine on this rank's share of the training mesh (collective: call on every rank)."""
    cls = engine_class(cfg.actor.strategy)
    if cfg.actor.strategy == "fsdp2" and dims.pp > 1:
        raise ValueError(
            f"parallel.pp={dims.pp} needs actor.strategy='megatron'; the fsdp2 engine has no pipeline"
        )
    return cls.from_config(  # type: ignore[attr-defined]
        cfg,
        role,
        model_path=model_path,
        dp_mesh=dims.fsdp_mesh,
        tp_mesh=dims.tp_mesh,
        device=device,
        total_steps=total_steps,
    )


__all__ = ["ENGINES", "LossFn", "LossScale", "TrainEngine", "build_engine", "engine_class"]
