"""The bytes of every phase of a step on one rank, component by component, for one set of decisions.

    phases = step_phases(models, engine, cfg, sizes, runtime, offload=False, checkpointing=False)
    phases["update"]   # {"runtime": b, "actor weights": b, "actor gradients": b, ...}

A phase holds what stays resident across the step (the process, every model's weights and optimizer
state unless offloaded while rollout runs, the sleeping rollout engine) plus its own work. The
components' arithmetic is in ``estimate.py``; which model a backend shards how is its ``layout``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from spmdrl.config.shape import ModelShape
from spmdrl.plan.estimate import (
    Sizes,
    activations,
    gathered,
    logprob_temporaries,
    micro_tokens,
    routing_record,
    trained_state,
)

if TYPE_CHECKING:
    from spmdrl.config import Config
    from spmdrl.engines.base import Layout
    from spmdrl.rollout.base import EngineMemory

PHASES = ("rollout", "weight_sync", "reward", "old_logp", "ref", "values", "update")


@dataclass(frozen=True)
class Model:
    """One model of the run as the plan sees it."""

    role: str  # actor, ref, critic, reward
    shape: ModelShape
    layout: "Layout"
    trained: bool
    lora_rank: int = 0
    logits: bool = True  # an LM head scores tokens (actor, ref); a critic or reward model has a scalar head

    @property
    def params(self) -> int:
        return self.shape.params if self.logits else self.shape.backbone_params + self.shape.hidden + 1

    @property
    def trainable(self) -> int:
        return self.shape.lora_params(self.lora_rank) if self.lora_rank else self.params


def resident(models: list[Model], s: Sizes, offloaded: bool) -> dict[str, float]:
    """What every model keeps across the step: trained ones their master weights and (unless offloaded)
    AdamW state, frozen ones their weights in the compute dtype."""
    out: dict[str, float] = {}
    for m in models:
        if m.trained:
            state = trained_state(m.params, m.trainable, m.layout.shards, s)
            out[f"{m.role} weights"] = state["weights"]
            if not offloaded:
                out[f"{m.role} optimizer"] = state["optimizer"]
        else:
            out[f"{m.role} weights"] = m.params * s.compute / m.layout.shards
    return out


def forward(m: Model, s: Sizes, rows: int, budget: Optional[int], *, train: bool, checkpointing: bool
            ) -> dict[str, float]:
    """What one forward (and backward when ``train``) of ``m`` on its largest micro-batch adds. Under SP the
    micro-batch is an SP group's (``rows`` gathered from its ranks, the token budget sp times a rank's), each
    rank 1/sp of its tokens, whose LM head scores every one of them (not only the response's)."""
    lay = m.layout
    budget = budget and budget * lay.sp
    tokens = micro_tokens(rows, s.seq, budget)
    out = {f"{m.role} activations": activations(m.shape, tokens, rows, s, train=train,
                                                checkpointing=checkpointing and train, tp=lay.tp,
                                                layers=lay.layers_per_rank, sp=lay.sp)}
    if lay.gathers:
        out[f"{m.role} gathered"] = gathered(m.shape, s, lay.tp)
    if m.logits:
        scored = micro_tokens(rows, s.response, budget) if lay.sp == 1 else math.ceil(tokens / lay.sp)
        out[f"{m.role} logits"] = logprob_temporaries(m.shape, scored, lay.tp, s.device_type)
    if train:
        state = trained_state(m.params, m.trainable, lay.shards, s)
        # The optimizer step runs after the backward freed its activations: only what it needs beyond them.
        out[f"{m.role} optimizer step"] = max(0.0, state["step"] - sum(out.values()))
        out[f"{m.role} gradients"] = state["gradients"]
    return out


def step_phases(models: list[Model], engine: "EngineMemory", cfg: "Config", s: Sizes, runtime: float,
                world: int, *, offload: bool, checkpointing: bool) -> dict[str, dict[str, float]]:
    """Every phase's components on one rank (bytes)."""
    a, c, ref, n = cfg.actor, cfg.critic, cfg.ref, cfg.rollout.n
    by_role = {m.role: m for m in models}
    held = cfg.data.train_batch_size * n // world  # rows this rank holds
    mini = {"actor": a.ppo_mini_batch_size * n // world, "critic": c.ppo_mini_batch_size * n // world}

    def pass_(role: str, micro: int, available: int, budget: Optional[int], train: bool) -> dict[str, float]:
        # A LoRA actor is its own reference (adapters off); a model replica gathers its TP (or SP) ranks'
        # rows.
        m = by_role.get(role) or by_role["actor"]
        rows = max(1, min(micro, available * m.layout.tp * m.layout.sp))
        return forward(m, s, rows, budget, train=train, checkpointing=checkpointing)

    base = {"runtime": runtime}
    record = routing_record(by_role["actor"].shape, held, s.seq)  # 0 for a dense model
    if record and _records_routes(cfg):  # an MoE model's experts per token, kept from rollout to update
        base["routing record"] = record
    awake = {**base, **resident(models, s, offload), "engine weights": engine.weights}
    training = {**base, **resident(models, s, False), "engine asleep": engine.asleep}
    phases = {
        "rollout": {**awake, "engine repacked": engine.repacked, "engine KV cache": engine.kv_cache,
                    "engine temporaries": engine.temporaries},
        "weight_sync": {**awake, "engine KV cache": engine.kept_kv, "sync transfer": engine.sync},
    }
    if "reward" in by_role:
        # The reward model scores each generation round inside the engine's awake window (colocated; split
        # placement's training ranks score what they received, and hold no engine).
        rm = cfg.reward_model
        phases["reward"] = {**awake, "engine KV cache": engine.kept_kv,
                            **pass_("reward", rm.micro_batch_size_per_gpu, held,
                                    _budget(rm.use_dynamic_bsz, rm.forward_max_token_len_per_gpu), False)}
    if _old_logp_pass(cfg, mini["actor"], held):
        logp_budget = _budget(a.log_prob_use_dynamic_bsz, a.log_prob_max_token_len_per_gpu)
        phases["old_logp"] = {**training, **pass_("actor", a.log_prob_micro_batch_size_per_gpu, held,
                                                  logp_budget, False)}
    if a.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        budget = _budget(ref.log_prob_use_dynamic_bsz, ref.log_prob_max_token_len_per_gpu)
        phases["ref"] = {**training, **pass_("ref", ref.log_prob_micro_batch_size_per_gpu, held, budget,
                                             False)}
    update = {**training, **pass_("actor", a.ppo_micro_batch_size_per_gpu, mini["actor"],
                                  _budget(a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu), True)}
    if "critic" in by_role:
        budget = _budget(c.use_dynamic_bsz, c.forward_max_token_len_per_gpu)
        values = pass_("critic", c.ppo_micro_batch_size_per_gpu, held, budget, False)
        phases["values"] = {**training, **values}
        critic_update = {**training, **pass_("critic", c.ppo_micro_batch_size_per_gpu, mini["critic"],
                                             _budget(c.use_dynamic_bsz, c.ppo_max_token_len_per_gpu), True)}
        update = max(update, critic_update, key=lambda p: sum(p.values()))  # they train one after the other
    phases["update"] = update
    return phases


def rollout_phases(engine: "EngineMemory", runtime: float, received: float) -> dict[str, dict[str, float]]:
    """A split placement's rollout rank: the engine alone, generating, or loading the weights the training
    ranks sent (``received``: all of them, held until the engine has read them) as its KV cache stays."""
    awake = {"runtime": runtime, "engine weights": engine.weights}
    return {"rollout": {**awake, "engine repacked": engine.repacked, "engine KV cache": engine.kv_cache,
                        "engine temporaries": engine.temporaries},
            "weight_sync": {**awake, "engine KV cache": engine.kv_cache, "weights received": received,
                            "sync transfer": engine.sync}}


def _old_logp_pass(cfg: "Config", mini: int, held: int) -> bool:
    """Whether the actor scores the batch before the update (the loop's rule: not for one on-policy pass
    that nothing before the update needs, nor in bypass mode; always for R2's routing record)."""
    rc = cfg.algorithm.rollout_correction
    one_pass = cfg.actor.ppo_epochs == 1 and mini >= held
    return not rc.bypass_mode and (not one_pass or cfg.algorithm.use_kl_in_reward or rc.corrects
                                   or cfg.actor.router_replay == "R2")


def _records_routes(cfg: "Config") -> bool:
    """Whether the batch carries an MoE model's routing: the rollout engine records it, or R2's pass does."""
    from spmdrl.rollout import rollout_engine_class

    return cfg.actor.router_replay == "R2" or rollout_engine_class(cfg.rollout.engine).records_routes


def _budget(on: bool, tokens: int) -> Optional[int]:
    return tokens if on else None
