"""Training engines, built by name so a run only imports the backend it uses.

    from spmdrl.engines import build_engine
    actor = build_engine(cfg, model_path, role="actor", dims=dims, device=device, total_steps=100)

``cfg.actor.strategy`` picks the backend: ``fsdp2`` (``spmdrl.engines.fsdp2.engine.FSDP2Engine``:
actor, reference, critic and reward model on a Hugging Face model) or ``megatron``
(``spmdrl.engines.megatron.engine.MegatronEngine``: megatron-core GPTModel with ``parallel.tp`` /
``parallel.pp``; actor, reference and critic, no reward model); both run on CPU and GPU. Each
engine class checks its own config keys (``check_config``) before any process group exists.

Both are ``TrainEngine``s (``base.py``): the interface the loop calls and the optimizer step,
written once there, with small hooks each backend fills. ``logprobs.py`` holds the log-prob /
entropy kernel that ends every actor forward; ``optim.py`` the AdamW and LR schedule both build.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from spmdrl.engines.base import LossFn, LossScale, Role, TrainEngine

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


def engine_class(strategy: str) -> type[TrainEngine]:
    """The engine class of ``strategy`` (``actor.strategy`` in the config), imported on demand."""
    if strategy not in ENGINES:
        raise ValueError(f"actor.strategy is {strategy!r}; valid strategies: {', '.join(sorted(ENGINES))}")
    return ENGINES[strategy]()


def build_engine(
    cfg: "Config",
    model_path: str,
    *,
    role: Role,
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


__all__ = ["ENGINES", "LossFn", "LossScale", "Role", "TrainEngine", "build_engine", "engine_class"]
