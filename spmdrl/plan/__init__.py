"""The memory plan: what every phase of a step holds on one rank, decided before any model is built.

    plan = make_plan(cfg, world_size=2, local_ranks=2)   # reads config.json, the device, this process
    plans = make_plans(cfg, 2, 2, "cuda")                # every role's (split placement: two)
    print(plan.table())                                  # rank 0 at start-up; --trainer.plan_only exits here
    plan.check()                                         # ConfigError naming the phase and the key to change
    cfg = plan.apply(cfg)                                # the decisions, into the resolved config

Inputs: the models' config.json (``spmdrl.config.shape``), precision, the parallel dimensions,
micro-batch sizes and token budgets, prompt and response lengths, n, LoRA, the rollout engine and its KV
settings (each backend says how it lays out a model, ``TrainEngine.layout``, and what its rollout engine
holds, ``RolloutEngine.memory``), the offload keys, and the memory one rank may use
(``budget.py``). Output: per phase (rollout, weight sync, old log-probs, reference, values, update) the
bytes of each component (``phases.py``), and its decisions, each printed with its reason:

- ``trainer.offload: auto``: the actor's and critic's optimizer state leave the device while rollout runs
  only when rollout does not fit next to it (never on CPU, where the device is the host);
- ``model.enable_gradient_checkpointing: auto``: on only when the update does not fit without it;
- ``rollout.sleep_level: null``: 2 on CPU, where level 1 would keep the engine's weights in the same
  memory through training, 1 on a GPU (``rollout.base.sleep_level``);
- ``rollout.gpu_memory_utilization: null``: vLLM / SGLang on a GPU get what training leaves free while
  rollout runs (at most 0.9 of the device).

A phase that does not fit even so stops the run before any work, naming the phase and the key that
would make it fit.

Under split placement each role gets a plan of its own (``role``): a training rank holds the models and
the buckets it sends, no engine (and no rollout phase, so never offload); a rollout rank the engine and,
while they load, the weights it received, which on a GPU leave the rest of the device to its KV cache.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from spmdrl.config.shape import ModelShape
from spmdrl.errors import ConfigError
from spmdrl.parallel import RankRole
from spmdrl.plan.budget import budget_bytes, device_total, process_bytes
from spmdrl.plan.estimate import GB, Sizes
from spmdrl.plan.phases import PHASES, Model, rollout_phases, step_phases
from spmdrl.rollout.base import EngineMemory

if TYPE_CHECKING:
    from spmdrl.config import Config

MARGIN = 0.10  # of the budget kept free: allocator fragmentation, and what the estimate leaves out
MAX_KV_FRACTION = 0.9
# What a split placement's rollout rank adds to its process on CPU besides its engine (torch.distributed,
# transformers' model classes; no training backend): measured 0.15 GB (AMD EPYC Zen 4, native engine).
ROLLOUT_RANK_RUNTIME_BYTES = 150 << 20


@dataclass
class Plan:
    device: str
    budget: float  # bytes one rank may hold
    phases: dict[str, dict[str, float]]  # phase -> component -> bytes
    engine: "EngineMemory"
    offload: bool
    checkpointing: bool
    kv_fraction: float | None  # gpu_memory_utilization for a library engine on a GPU; None: not decided
    decisions: list[str] = field(default_factory=list)
    role: RankRole = RankRole.COLOCATED  # the role of the ranks planned for
    other_roles: dict[str, dict] = field(default_factory=dict)  # split placement: the others' summaries

    def peak(self, phase: str) -> float:
        return sum(self.phases[phase].values())

    def problem(self) -> Optional[str]:
        """One sentence for the first phase that does not fit, or None."""
        limit = self.budget * (1 - MARGIN)
        for phase in self.phases:
            need = self.peak(phase)
            if need > limit:
                return (f"the memory plan finds that the {phase} phase needs {need / GB:.1f} GB on each "
                        f"{self.role.label + ' ' if self.role.label else ''}rank "
                        f"but a rank has {limit / GB:.1f} GB of this {self.device}'s memory "
                        f"({self.budget / GB:.1f} GB less a {MARGIN:.0%} margin); {_remedy(phase)} "
                        f"(--trainer.plan_only true prints the plan)")
        return None

    def check(self) -> None:
        """ConfigError with one sentence for the first phase that does not fit."""
        problem = self.problem()
        if problem is not None:
            raise ConfigError(problem)

    def verdict(self) -> str:
        problem = self.problem()
        return f"  verdict: does not fit: {problem}" if problem else "  verdict: every phase fits"

    def apply(self, cfg: "Config") -> "Config":
        """A copy of ``cfg`` with the decisions made: booleans and numbers where it said auto."""
        out = copy.deepcopy(cfg)
        out.model.enable_gradient_checkpointing = self.checkpointing
        out.trainer.offload = "always" if self.offload else "never"
        if self.kv_fraction is not None:
            out.rollout.gpu_memory_utilization = self.kv_fraction
        return out

    def summary(self) -> dict:
        """The plan as JSON (plan.json beside metrics.jsonl): GB per component and phase, the decisions."""
        return {"device": self.device, "role": self.role.value, "budget_gb": self.budget / GB,
                "peak_gb": {p: self.peak(p) / GB for p in self.phases},
                "phases_gb": {p: {k: v / GB for k, v in c.items()} for p, c in self.phases.items()},
                "decisions": self.decisions, "offload": self.offload,
                "activation_checkpointing": self.checkpointing, "gpu_memory_utilization": self.kv_fraction,
                **({"other_roles": self.other_roles} if self.other_roles else {})}

    def table(self) -> str:
        """The plan as one table (GB per rank), the decisions below it."""
        components = list(dict.fromkeys(k for p in self.phases.values() for k, v in p.items() if v))
        names = [p for p in PHASES if p in self.phases]
        width = max(len(c) for c in components + ["component"])
        role = self.role.label + " " if self.role.label else ""
        lines = [f"memory plan, GB per {role}rank on {self.device} "
                 f"({self.budget / GB:.1f} GB for each {role}rank):",
                 f"  {'component':<{width}} " + " ".join(f"{p:>11}" for p in names)]
        for c in components:
            cells = [f"{self.phases[p][c] / GB:11.3f}" if self.phases[p].get(c) else " " * 11 for p in names]
            lines.append(f"  {c:<{width}} " + " ".join(cells))
        lines.append(f"  {'peak':<{width}} " + " ".join(f"{self.peak(p) / GB:11.3f}" for p in names))
        if self.engine.elsewhere:
            lines.append(f"  not counted above: {self.engine.elsewhere}")
        return "\n".join(lines + [f"  decision: {d}" for d in self.decisions])


def _remedy(phase: str) -> str:
    return {
        "rollout": "lower rollout.max_num_seqs or data.max_response_length, or set trainer.offload always",
        "weight_sync": "lower rollout.update_weights_bucket_megabytes, or set trainer.offload always",
        "old_logp": "lower actor.log_prob_micro_batch_size_per_gpu (or its token budget)",
        "ref": "lower ref.log_prob_micro_batch_size_per_gpu, or set ref.offload true",
        "values": "lower critic.ppo_micro_batch_size_per_gpu (or critic.forward_max_token_len_per_gpu)",
        "update": "lower actor.ppo_micro_batch_size_per_gpu (or its token budget), set "
                  "model.enable_gradient_checkpointing true, or shard over more ranks",
    }[phase]


def models(cfg: "Config", world_size: int) -> list[Model]:
    """The run's models with their shapes and their backend's layout on one rank."""
    import spmdrl.algos  # noqa: F401  (fills the registries)
    from spmdrl.algos.registry import ADVANTAGES
    from spmdrl.engines import engine_class
    from spmdrl.parallel import ParallelDims

    dims = ParallelDims.of(cfg, world_size)
    backend = engine_class(cfg.actor.strategy)
    actor = ModelShape.of(cfg.model.path)
    out = [Model("actor", actor, backend.layout(cfg, dims, actor.layers), True, cfg.model.lora_rank)]
    if (cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward) and not cfg.model.lora_rank:
        out.append(Model("ref", actor, backend.layout(cfg, dims, actor.layers), False))
    if ADVANTAGES.meta(cfg.algorithm.adv_estimator).get("needs_values"):
        critic = ModelShape.of(cfg.critic.model_path or cfg.model.path)
        out.append(Model("critic", critic, backend.layout(cfg, dims, critic.layers), True,
                         cfg.critic.lora_rank, logits=False))
    if cfg.reward_model.enable and cfg.reward_model.model.path:
        rm = ModelShape.of(cfg.reward_model.model.path)
        out.append(Model("reward", rm, backend.layout(cfg, dims, rm.layers), False, logits=False))
    return out


def make_plans(cfg: "Config", world_size: int, local_ranks: int, device_type: str) -> dict[RankRole, Plan]:
    """Every role's plan (``make_plan``): one colocated, two under split placement (training, rollout),
    each carrying the others' summaries (plan.json holds them all)."""
    from spmdrl.parallel import ParallelDims

    plans = {role: make_plan(cfg, world_size, local_ranks, device_type, role)
             for role in ParallelDims.of(cfg, world_size).roles()}
    for role, plan in plans.items():
        plan.other_roles = {other.value: p.summary() for other, p in plans.items() if other != role}
    return plans


def make_plan(cfg: "Config", world_size: int, local_ranks: int, device_type: str,
              role: RankRole = RankRole.COLOCATED) -> Plan:
    """The plan of ``cfg`` on ``world_size`` ranks, ``local_ranks`` of them on this node's device (the
    host's memory on CPU), for a rank of ``role`` (``ParallelDims.role``; under split placement each role
    holds only its own part)."""
    from spmdrl.parallel import ParallelDims
    from spmdrl.rollout import rollout_engine_class

    dims = ParallelDims.of(cfg, world_size)
    role = RankRole(role)
    assert role in dims.roles(), (role, dims.roles())
    sizes = Sizes.of(cfg, device_type)
    run_models = models(cfg, world_size)
    engine = rollout_engine_class(cfg.rollout.engine).memory(cfg, run_models[0].shape, device_type,
                                                              dims.rollout_dp, dims.rollout_tp)
    runtime = 0.0
    if device_type == "cpu":  # the process, and what the engine and the training backend add to it
        backend = run_models[0].layout.runtime_bytes if role.trains else ROLLOUT_RANK_RUNTIME_BYTES
        runtime = process_bytes() + (engine.runtime if role.generates else 0.0) + backend
    budget = budget_bytes(device_type, local_ranks)
    # A split placement's training ranks hold no engine, only the bucket they send; while the update runs
    # under staleness 1+, training rank 0 still holds the buckets being sent (up to the whole model).
    sending = EngineMemory(0.0, 0.0, 0.0, 0.0, sync=engine.sync)
    whole = run_models[0].shape.params * sizes.rollout  # the policy in the rollout dtype, as it travels
    in_flight = whole if cfg.rollout.max_staleness >= 1 else 0.0

    def phases(offload: bool, checkpointing: bool) -> dict[str, dict[str, float]]:
        if not role.trains:
            return rollout_phases(engine, runtime, whole)
        out = step_phases(run_models, engine if role.generates else sending, cfg, sizes, runtime,
                          dims.train_ranks, offload=offload, checkpointing=checkpointing)
        if not role.generates:  # no rollout phase, no engine
            del out["rollout"]
            out = {name: {k: v for k, v in held.items() if not k.startswith("engine")}
                   for name, held in out.items()}
            for name in PHASES[2:]:
                if name in out and in_flight:
                    out[name]["weights being sent"] = in_flight
        return out

    from spmdrl.plan.decide import decide

    offload, checkpointing, kv_fraction, lines = decide(cfg, phases, budget, device_type, engine,
                                                        device_total(device_type), MARGIN, MAX_KV_FRACTION)
    return Plan(device_type, budget, phases(offload, checkpointing), engine, offload, checkpointing,
                kv_fraction, lines, role=role)
