"""The memory plan's device-dependent choices, planned from the built-in model's shapes (nothing built)."""

from __future__ import annotations

from pathlib import Path

from spmdrl.config.parse import parse_config
from spmdrl.plan import make_plan
from spmdrl.rollout.base import sleep_level

REPO = Path(__file__).resolve().parents[2]


def _cfg(*extra: str):
    cfg, _ = parse_config(["--config", str(REPO / "configs/grpo.yaml"), *extra])
    return cfg


def test_sleep_level_null_frees_the_engine_weights_on_cpu_and_keeps_them_on_a_gpu():
    cfg = _cfg()
    assert cfg.rollout.sleep_level is None
    assert (sleep_level(cfg, "cpu"), sleep_level(cfg, "cuda")) == (2, 1)
    freed, kept = make_plan(cfg, 1, 1, "cpu"), make_plan(_cfg("--rollout.sleep_level", "1"), 1, 1, "cpu")
    weights = kept.engine.weights
    assert freed.engine.asleep == 0 and kept.engine.asleep == weights > 0
    # Level 1 on CPU holds the engine's copy through the update; level 2 holds nothing of it.
    assert kept.phases["update"]["engine asleep"] == weights
    assert not freed.phases["update"].get("engine asleep")
    assert any(d.startswith("rollout sleep level 2: on CPU level 1 would keep") for d in freed.decisions)
    assert "rollout sleep level 1: rollout.sleep_level is 1" in kept.decisions
