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


def test_split_placement_plans_each_role_for_what_it_holds(monkeypatch):
    """Under split a training rank holds no engine (only the bucket it sends; off-policy rank 0 keeps the
    buckets being sent through the update), a rollout rank only the engine and, while they load, the
    weights it received: on a GPU its KV cache gets what those leave."""
    import spmdrl.plan as plan

    gpu = 80.0 * 1024**3
    monkeypatch.setattr(plan, "device_total", lambda device_type: gpu)
    monkeypatch.setattr(plan, "budget_bytes", lambda device_type, local_ranks: gpu)
    split = ["--rollout.engine", "vllm", "--model.path", "builtin:qwen2.5-1.5b-shape", "--rollout.placement",
             "split", "--rollout.n_gpus_per_node", "1", "--data.train_batch_size", "4",
             "--actor.ppo_mini_batch_size", "4"]
    colocated = make_plan(_cfg(*split[:4]), 2, 2, "cuda")
    training = make_plan(_cfg(*split), 2, 2, "cuda", "training")
    rollout = make_plan(_cfg(*split), 2, 2, "cuda", "rollout")
    fresh = make_plan(_cfg(*split, "--rollout.max_staleness", "0"), 2, 2, "cuda", "training")
    assert "rollout" not in training.phases and set(rollout.phases) == {"rollout", "weight_sync"}
    assert not any(k.startswith("engine") for p in training.phases.values() for k in p)
    assert not any(k.startswith(("actor", "ref")) for p in rollout.phases.values() for k in p)
    sent = training.phases["update"]["weights being sent"]
    assert sent == rollout.engine.weights > 0 and "weights being sent" not in fresh.phases["update"]
    assert not training.offload and training.kv_fraction is None
    # What the rollout rank's KV cache gives way to: the weights received (all of them, until loaded) and
    # the own-process vLLM worker's staged copy of them, not the training state.
    whole = rollout.engine.weights
    assert rollout.phases["weight_sync"]["weights received"] == rollout.phases["weight_sync"]["sync transfer"]
    assert rollout.phases["weight_sync"]["sync transfer"] == whole
    assert rollout.kv_fraction == round((0.9 * gpu - 2 * whole) / gpu, 3) and colocated.kv_fraction
    assert any("what the received weights leave free" in d for d in rollout.decisions)
    assert "GB per training rank" in training.table() and "GB per rollout rank" in rollout.table()


def test_the_reward_models_forward_is_planned_by_its_micro_batch():
    """The reward model scores each round in a phase of its own, whose activations grow with its micro-batch
    (issue 44: the plan held its weights only, the same peaks for micro-batches of 1 and 100,000)."""
    rm = ["--reward_model.enable", "true", "--reward_model.model.path", "builtin:tiny-rm",
          "--data.train_batch_size", "1024"]
    small, large = (make_plan(_cfg(*rm, "--reward_model.micro_batch_size_per_gpu", str(m)), 1, 1, "cpu")
                    for m in (1, 100000))
    grow = large.phases["reward"]["reward activations"] / small.phases["reward"]["reward activations"]
    assert grow > 1000  # 8,192 rows in one micro-batch against one row
    assert sum(large.phases["reward"].values()) > sum(large.phases["update"].values())
    assert "reward" not in make_plan(_cfg(), 1, 1, "cpu").phases


def test_sequence_parallelism_splits_each_ranks_tokens():
    """SP 2 on 2 ranks runs an SP group's micro-batch (both ranks' rows) with half its tokens on each rank:
    about half the activations of one rank running those rows alone, plus the all-to-all's buffers, and the
    LM head scores every token of the slice; weights and optimizer state are sharded over dp x sp."""
    long = ["--data.max_prompt_length", "512", "--data.max_response_length", "3584",
            "--data.train_batch_size", "2", "--rollout.n", "1", "--actor.ppo_mini_batch_size", "2",
            "--actor.ppo_micro_batch_size_per_gpu", "2", "--model.enable_gradient_checkpointing", "false"]
    one = make_plan(_cfg(*long), 1, 1, "cpu").phases["update"]
    two = make_plan(_cfg(*long, "--parallel.sp", "2"), 2, 2, "cpu").phases["update"]
    ratio = two["actor activations"] / one["actor activations"]
    assert 0.5 < ratio < 0.75, ratio
    assert two["actor weights"] == one["actor weights"] / 2
    assert two["actor logits"] >= one["actor logits"]  # the prompt's tokens are scored too (then dropped)
