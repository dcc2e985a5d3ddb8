"""Engine helpers without a process group: LR schedule, optimizer groups, registry, attention rule."""

from __future__ import annotations

import math

import pytest
import torch.nn as nn

from spmdrl.engines import engine_class
from spmdrl.engines.optim import WarmupSchedule, build_optimizer, build_scheduler


def test_warmup_then_constant():
    s = WarmupSchedule(4, "constant", 0.0, None)
    assert [s(i) for i in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_warmup_then_cosine_to_floor():
    s = WarmupSchedule(2, "cosine", 0.1, 12)
    assert s(0) == 0.5 and s(1) == 1.0
    assert s(2) == pytest.approx(1.0)  # cosine starts at the peak
    assert s(7) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s(12) == pytest.approx(0.1) and s(50) == pytest.approx(0.1)


def test_schedule_errors_name_the_value():
    with pytest.raises(ValueError, match="total_steps"):
        WarmupSchedule(0, "cosine", 0.0, None)
    with pytest.raises(ValueError, match="'linear'"):
        WarmupSchedule(0, "linear", 0.0, 10)  # type: ignore[arg-type]


def test_scheduler_drives_optimizer_lr():
    model = nn.Linear(3, 3)
    opt = build_optimizer(model, lr=1.0, weight_decay=0.1, betas=(0.9, 0.99))
    sched = build_scheduler(opt, 2, "constant", 0.0, None)
    lrs = []
    for _ in range(3):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == [0.5, 1.0, 1.0]


def test_no_weight_decay_on_biases_and_norms():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.99))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and [p.dim() for p in decay["params"]] == [2]
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 3


def test_engine_registry_errors():
    with pytest.raises(ValueError, match="actor.strategy is 'deepspeed'; valid strategies: fsdp2"):
        engine_class("deepspeed")
    assert engine_class("fsdp2").__name__ == "FSDP2Engine"


def test_attention_kernel_auto_rule():
    from spmdrl.engines.fsdp2.engine import resolve_attn_implementation

    assert resolve_attn_implementation("auto", "cpu", 80) == "eager"  # measured ~3x faster backward on CPU
    assert resolve_attn_implementation("auto", "cpu", 4096) == "sdpa"  # eager's [L, L] scores get too big
    assert resolve_attn_implementation("auto", "cuda", 80) == "sdpa"
    assert resolve_attn_implementation("eager", "cuda", 4096) == "eager"  # an explicit choice is kept
