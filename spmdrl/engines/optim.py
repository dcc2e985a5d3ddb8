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

    The first optimizer step already uses ``1 / warmup_steps`` of the peak
    (not 0), so no step is wasted. Cosine decays over the steps after
    warm-up up to ``total_steps`` and stays at the floor after that. A class,
    not a closure, so ``LambdaLR.state_dict`` records its settings.
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
                "lr_scheduler='cosine' needs total_steps (optimizer steps of the run), got None/0"
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
