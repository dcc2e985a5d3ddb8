"""Training engines, built by name so a run only imports the backend it uses.

    from spmdrl.engines import build_engine
    actor = build_engine(cfg, model_path, role="actor", dims=dims, device=device, total_steps=100)

``cfg.actor.strategy`` picks the backend: ``fsdp2`` (``spmdrl.engines.fsdp2.engine.FSDP2Engine``:
actor, reference, critic and reward model on a Hugging Face model) or ``megatron``
(``spmdrl.engines.megatron.engine.MegatronEngine``: megatron-core GPTModel with ``parallel.tp`` /
``parallel.pp``; actor, reference and critic, no reward model); both run on CPU and GPU. Each
engine class checks its own config keys (``check_config``) before any process group exists.

Both are ``TrainEngine``s (``base.py``): the interface the loop calls and the optimizer step,
written once there, with small hooks each backend fills. ``logprobs.py`` holds the fused LM-head
log-prob / entropy kernel that ends every actor and reference forward (from the final hidden states, so
no [tokens x vocabulary] logits exist); ``optim.py`` the AdamW and LR schedule both build.

Each engine also owns reading its checkpoint folder back as Hugging Face tensors in one plain process
(``fsdp2/checkpoint.py``, ``megatron/checkpoint.py``); ``spmdrl.export`` looks the reader up by the
strategy the checkpoint's manifest records:

    weights = checkpoint_reader("megatron")(step_dir / "actor", step_dir / "model_files", manifest, "actor")
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from spmdrl.engines.base import LossFn, LossScale, ModelRole, TrainEngine

if TYPE_CHECKING:
    from spmdrl.config import Config
    from spmdrl.parallel import ParallelDims

def _fsdp2() -> type[TrainEngine]:
    from spmdrl.engines.fsdp2.engine import FSDP2Engine

    return FSDP2Engine


def _megatron() -> type[TrainEngine]:
    import warnings

    try:
        # Its notices that Apex / Transformer Engine are absent: we use neither.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import megatron.core  # noqa: F401
    except ImportError as err:
        raise ImportError(f"actor.strategy 'megatron' needs megatron-core, which is not importable here "
                          f"({err}); pip install -c constraints.txt 'megatron-core==0.16.1'") from err
    from spmdrl.engines.megatron.engine import MegatronEngine

    return MegatronEngine


# strategy name (actor.strategy) -> factory returning the class; a backend is imported only when chosen.
ENGINES: dict[str, Callable[[], type[TrainEngine]]] = {"fsdp2": _fsdp2, "megatron": _megatron}


# (engine folder global_step_N/{role}, model_files folder, manifest, role) -> (hf_name, full tensor) pairs
CheckpointReader = Callable[[Path, Path, dict, str], Iterator[tuple[str, torch.Tensor]]]


def _fsdp2_reader() -> CheckpointReader:
    from spmdrl.engines.fsdp2.checkpoint import read_checkpoint

    return read_checkpoint


def _megatron_reader() -> CheckpointReader:
    from spmdrl.engines.megatron.checkpoint import read_checkpoint  # needs no megatron.core

    return read_checkpoint


# strategy name (a manifest's "strategies") -> factory returning its checkpoint reader, imported on demand.
READERS: dict[str, Callable[[], CheckpointReader]] = {"fsdp2": _fsdp2_reader, "megatron": _megatron_reader}


def checkpoint_reader(strategy: str) -> CheckpointReader:
    """The function that reads a checkpoint folder written by the ``strategy`` engine."""
    if strategy not in READERS:
        raise ValueError(f"engine format {strategy!r} has no checkpoint reader; valid: "
                         f"{', '.join(sorted(READERS))}")
    return READERS[strategy]()


def engine_class(strategy: str) -> type[TrainEngine]:
    """The engine class of ``strategy`` (``actor.strategy`` in the config), imported on demand."""
    if strategy not in ENGINES:
        raise ValueError(f"actor.strategy is {strategy!r}; valid strategies: {', '.join(sorted(ENGINES))}")
    return ENGINES[strategy]()


def build_engine(
    cfg: "Config",
    model_path: str,
    *,
    role: ModelRole,
    dims: "ParallelDims",
    device: torch.device,
    total_steps: int | None = None,
) -> TrainEngine:
    """The ``role`` engine on this rank's share of the training mesh (collective: call on every rank)."""
    return engine_class(cfg.actor.strategy).from_config(
        cfg,
        role,
        model_path=model_path,
        dims=dims,
        device=device,
        total_steps=total_steps,
    )


__all__ = ["ENGINES", "READERS", "CheckpointReader", "LossFn", "LossScale", "ModelRole", "TrainEngine",
           "build_engine", "checkpoint_reader", "engine_class"]
