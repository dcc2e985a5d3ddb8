"""AdamW, its learning-rate schedule and the moves of its state, shared by every engine.

Nothing here depends on how parameters are sharded (FSDP2 DTensors, Megatron TP shards or plain
tensors): the optimizer is elementwise over whatever this rank holds. ``value_head_weight`` is the
critic's initial head, so both engines start a critic from the same values.
"""

from __future__ import annotations

import math
from typing import Callable, Literal

import torch
import torch.nn as nn


def build_optimizer(
    model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float]
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; biases and norm weights (1-D) get no weight decay.

    Decaying gains and biases pulls them towards 0, which changes what the
    layer computes rather than regularising it, so they are left out.
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # foreach: one fused kernel launch per group; DTensor supports it as long as a group shares a mesh per op.
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, foreach=True)


def value_head_weight(hidden_size: int, seed: int) -> torch.Tensor:
    """A critic's initial value-head weight [1, H] (its bias starts at 0), the same on every rank and engine.

    Small seeded weights: values start near 0 and the backbone still gets a gradient.
    """
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, hidden_size, generator=gen) / (hidden_size * math.sqrt(hidden_size))


class WarmupSchedule:
    """LR multiplier: linear warm-up to 1 over ``warmup_steps``, then constant or cosine to ``min_lr_ratio``.

    Steps are training steps (the engine advances the schedule once per
    ``train_step``, whatever its mini-batches and epochs). The first step
    already uses ``1 / warmup_steps`` of the peak (not 0), so no step is
    wasted. Cosine decays over the steps after warm-up up to ``total_steps``
    and stays at the floor after that. A class, not a closure, so
    ``LambdaLR.state_dict`` records its settings.
    """

    def __init__(
        self,
        warmup_steps: int,
        kind: Literal["constant", "cosine"],
        min_lr_ratio: float,
        total_steps: int | None,
    ):
        if kind not in ("constant", "cosine"):
            raise ValueError(f"lr_scheduler={kind!r} is not supported; valid: constant, cosine")
        if kind == "cosine" and not total_steps:
            raise ValueError(
                "lr_scheduler='cosine' needs total_steps (training steps of the run), got None/0"
            )
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio={min_lr_ratio} must be in [0, 1]")
        self.warmup_steps = max(0, warmup_steps)
        self.kind = kind
        self.min_lr_ratio = min_lr_ratio
        self.total_steps = total_steps or 0

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    kind: Literal["constant", "cosine"],
    min_lr_ratio: float,
    total_steps: int | None,
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, WarmupSchedule(warmup_steps, kind, min_lr_ratio, total_steps)
    )


def move_optimizer_state(
    optimizer: torch.optim.Optimizer, where: Callable[[nn.Parameter], torch.device]
) -> None:
    """Move every optimizer state tensor of parameter ``p`` to ``where(p)`` (offload / onload)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for k, v in state.items():
                # Adam's "step" is a CPU scalar by design (non-capturable): leave it where it is.
                # Blocking copies: a non-blocking D2H copy may be read before it lands.
                if isinstance(v, torch.Tensor) and k != "step":
                    state[k] = v.to(where(p))


# Param-group values a resume takes from the config rather than the checkpoint (lr and initial_lr follow
# the schedule); a difference in any other value (amsgrad, maximize, ...) cannot be applied to saved state.
_APPLIED = ("betas", "weight_decay", "eps", "foreach", "fused", "capturable", "differentiable")
_SCHEDULE_KEYS = {"warmup_steps": "lr_warmup_steps", "kind": "lr_scheduler", "min_lr_ratio": "min_lr_ratio",
                  "total_steps": "lr schedule length (training steps)"}


def _plain(value: object) -> object:
    """A list as the tuple it was before a checkpoint round trip (betas)."""
    return tuple(value) if isinstance(value, list) else value


def optimizer_settings(optimizer: torch.optim.Optimizer,
                       scheduler: torch.optim.lr_scheduler.LambdaLR) -> dict:
    """The hyperparameters and schedule an engine was built with (call it before loading a checkpoint)."""
    return {
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "base_lrs": list(scheduler.base_lrs),
        "schedules": [dict(vars(fn)) for fn in scheduler.lr_lambdas],
    }


def restore_settings(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
                     configured: dict, role: str) -> list[str]:
    """After a checkpoint's optimizer and scheduler state were loaded: put back the ``configured``
    hyperparameters and schedule (``optimizer_settings``), each group's lr being the configured schedule's
    at the resumed step; the moments and the step count stay the checkpoint's.

    Returns one line per value that differed ("actor.lr: 0.001 in the checkpoint -> 0.0005 configured");
    raises ValueError for a difference that cannot be applied to the saved state. With nothing changed the
    values are recomputed by the scheduler's own formula, so a resume stays bitwise exact.
    """
    if len(configured["groups"]) != len(optimizer.param_groups):
        raise ValueError(f"the checkpoint's {role} optimizer has {len(optimizer.param_groups)} parameter "
                         f"groups but this run's has {len(configured['groups'])}; resume with the code and "
                         f"config that saved it")
    changes: dict[str, str] = {}

    def note(key: str, saved: object, wanted: object) -> None:
        if _plain(saved) != _plain(wanted) and key not in changes:
            changes[key] = f"{role}.{key}: {saved} in the checkpoint -> {wanted} configured"

    for group, wanted in zip(optimizer.param_groups, configured["groups"]):
        for key, value in wanted.items():
            if key not in (*_APPLIED, "lr", "initial_lr") and _plain(group.get(key)) != _plain(value):
                raise ValueError(f"the checkpoint's {role} optimizer has {key}={group.get(key)!r} but this "
                                 f"run builds {key}={value!r}, which a resume cannot change; resume with "
                                 f"the settings that saved it or start afresh")
            if key in _APPLIED:
                note(key, group.get(key), value)
            group[key] = value
    for saved, wanted in zip(scheduler.base_lrs, configured["base_lrs"]):
        note("lr", saved, wanted)
    for fn, wanted in zip(scheduler.lr_lambdas, configured["schedules"]):
        for key, value in wanted.items():
            note(_SCHEDULE_KEYS.get(key, key), vars(fn).get(key), value)
        vars(fn).update(wanted)
    scheduler.base_lrs = list(configured["base_lrs"])
    for group, base_lr, fn in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["initial_lr"] = base_lr
        group["lr"] = base_lr * fn(scheduler.last_epoch)  # LambdaLR.get_lr's formula
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports
    return list(changes.values())
