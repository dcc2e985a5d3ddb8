"""Engine helpers without a process group: LR schedule, optimizer groups, the configured settings a resume
keeps, registry, attention rule."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from spmdrl.engines import engine_class
from spmdrl.engines.optim import (
    WarmupSchedule,
    build_optimizer,
    build_scheduler,
    optimizer_settings,
    restore_settings,
)


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


def _trained(lr: float = 1e-3, betas: tuple = (0.9, 0.999), weight_decay: float = 0.0, warmup: int = 2,
             kind: str = "cosine", floor: float = 0.1, total: int = 10, steps: int = 3):
    """A model, its AdamW and schedule after ``steps`` steps (the same weights and gradients every time)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    opt = build_optimizer(model, lr=lr, weight_decay=weight_decay, betas=betas)
    sched = build_scheduler(opt, warmup, kind, floor, total)
    for _ in range(steps):
        model(torch.ones(2, 4)).square().sum().backward()
        opt.step()
        sched.step()
    return opt, sched


def _resumed(saved, **config):
    """A fresh optimizer built from ``config`` that loads the ``saved`` one's state, as an engine resumes."""
    opt, sched = _trained(steps=0, **config)
    configured = optimizer_settings(opt, sched)
    opt.load_state_dict(saved[0].state_dict())
    sched.load_state_dict(saved[1].state_dict())
    return opt, sched, restore_settings(opt, sched, configured, "actor")


def test_resume_with_the_same_config_restores_the_checkpoint_bitwise():
    saved = _trained()
    opt, sched, changes = _resumed(saved)
    assert changes == []
    settings = lambda groups: [{k: v for k, v in g.items() if k != "params"} for g in groups]  # noqa: E731
    assert settings(opt.param_groups) == settings(saved[0].param_groups)
    assert sched.get_last_lr() == saved[1].get_last_lr() and sched.last_epoch == 3


def test_resume_applies_the_configured_hyperparameters_and_schedule():
    opt, sched, changes = _resumed(_trained(), lr=5e-4, betas=(0.8, 0.95), weight_decay=0.1, warmup=0,
                                   kind="constant", total=20)
    assert sorted(changes) == [
        "actor.betas: (0.9, 0.999) in the checkpoint -> (0.8, 0.95) configured",
        "actor.lr schedule length (training steps): 10 in the checkpoint -> 20 configured",
        "actor.lr: 0.001 in the checkpoint -> 0.0005 configured",
        "actor.lr_scheduler: cosine in the checkpoint -> constant configured",
        "actor.lr_warmup_steps: 2 in the checkpoint -> 0 configured",
        "actor.weight_decay: 0.0 in the checkpoint -> 0.1 configured",
    ]
    decay, no_decay = opt.param_groups
    assert decay["betas"] == no_decay["betas"] == (0.8, 0.95)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert decay["lr"] == no_decay["lr"] == 5e-4 and sched.get_last_lr() == [5e-4, 5e-4]  # constant at step 3
    assert sched.last_epoch == 3 and opt.state  # the step count and Adam's moments are the checkpoint's
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 5e-4  # the scheduler goes on with the configured schedule


def test_resume_with_the_cosine_schedule_stretched_takes_its_lr_at_the_resumed_step():
    opt, sched, changes = _resumed(_trained(), total=30)
    assert changes == ["actor.lr schedule length (training steps): 10 in the checkpoint -> 30 configured"]
    assert opt.param_groups[0]["lr"] == 1e-3 * WarmupSchedule(2, "cosine", 0.1, 30)(3)


def test_resume_refuses_a_change_it_cannot_apply():
    saved = _trained()
    opt, sched = _trained(steps=0)
    for group in opt.param_groups:
        group["amsgrad"] = True  # needs moments the checkpoint does not have
    configured = optimizer_settings(opt, sched)
    opt.load_state_dict(saved[0].state_dict())
    sched.load_state_dict(saved[1].state_dict())
    with pytest.raises(ValueError, match="optimizer has amsgrad=False but this run builds amsgrad=True, "
                                         "which a resume cannot change"):
        restore_settings(opt, sched, configured, "actor")


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


def test_compile_auto_rule():
    from spmdrl.engines.fsdp2.engine import resolve_compile

    assert resolve_compile("auto", "cuda") is True  # measured best on an H200 (docs/gpu.md, 2026-11-28)
    assert resolve_compile("auto", "cpu") is False  # a short CPU run pays more compile than it wins
    assert resolve_compile(True, "cpu") is True and resolve_compile(False, "cuda") is False
