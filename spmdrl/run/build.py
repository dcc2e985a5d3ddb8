"""What a rank holds for an RL run, and how it is built (``build``), by its role (``parallel.RankRole``):

    RunCommon       every rank: config, meshes, data, timer, watchdog, plan, the step
    Trainer         the training side: actor, reference, critic, KL controller, losses (and under split
                    placement the reward model the training ranks score with)
    ColocatedRun    RunCommon + a Trainer + an Experience (rollout engine, agent, reward sources), whose
                    engine takes the weights straight from the actor
    TrainingRun     RunCommon + a Trainer          (split placement: spmdrl/split/)
    RolloutRun      RunCommon + an Experience      (split placement: the weights come from the exchange)

A rank's run is one of the three, so code that reaches a side its rank does not hold fails a type check.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, TypeVar, Union

import torch
import torch.distributed as dist

from spmdrl.algos.kl import build_kl_controller
from spmdrl.algos.registry import ADVANTAGES
from spmdrl.builtin import resolve_builtins
from spmdrl.checkpoint.watchdog import Watchdog
from spmdrl.config import Config, dump_config, output_dir
from spmdrl.data import PromptLoader, ValidationLoader, build_loaders
from spmdrl.engines import build_engine, engine_class
from spmdrl.engines.base import LogProbSource, LossFn, TrainEngine
from spmdrl.experience import Experience
from spmdrl.metrics import MetricsSink, PhaseTimer
from spmdrl.objectives import actor_loss_fn, critic_loss_fn
from spmdrl.parallel import ParallelDims, RankRole, device_for_rank, rollout_coords
from spmdrl.plan import Plan, make_plans
from spmdrl.precision import EMULATED_BF16_SLOWDOWN, precision_summary, resolve_dtype
from spmdrl.reward.sources import Rewards, build_rewards
from spmdrl.run.upkeep import Validation, open_output

log = logging.getLogger("spmdrl")


@dataclass(kw_only=True)
class RunCommon:
    """What every rank of an RL run holds, whatever its role."""

    cfg: Config  # ``builtin:`` paths resolved (spmdrl.builtin.resolve_builtins), the plan's decisions made
    config_text: str  # the config as the user gave it (config.yaml, checkpoints)
    dims: ParallelDims
    role: RankRole
    device: torch.device
    rank: int
    out_dir: Path
    tokenizer: Any
    train_loader: PromptLoader
    val_loader: Optional[ValidationLoader]
    validation: Validation  # when validation is due
    timer: PhaseTimer  # each phase start is a heartbeat of ``watchdog``
    watchdog: Watchdog
    total_steps: int
    plan: Plan  # the memory plan (spmdrl/plan) and its decisions
    step: int = 0

    @property
    def group(self) -> dist.ProcessGroup:
        """The ranks this rank's share of the batch is reduced over: the world colocated; under split
        placement this rank's role's ranks (ParallelDims.batch_group)."""
        return self.dims.batch_group

    @property
    def batch_ranks(self) -> int:
        """How many ranks the batch is sharded over (the size of ``group``)."""
        return dist.get_world_size(self.group)

    def open_output(self, resumed: bool) -> MetricsSink:
        """The run folder (rank 0; a generation dump's folder is the run's too) and the metrics sink."""
        dump = self.cfg.trainer.rollout_data_dir
        return open_output(self, resumed, name=self.cfg.algorithm.adv_estimator, plan=self.plan.summary(),
                           also_set_aside=(Path(dump).parts[0],) if dump else ())

    def close(self) -> None:
        """What the rank holds besides its engines: the watchdog, and each side's reward and tool workers."""
        self.watchdog.close()


@dataclass
class Trainer:
    """The training side of a rank: what learns from a scored batch (``spmdrl.run.learn``)."""

    actor: TrainEngine
    ref: Optional[LogProbSource]  # when a KL term uses it
    critic: Optional[TrainEngine]  # when the estimator needs values
    kl_ctrl: Any
    actor_loss: LossFn
    critic_loss: LossFn
    offload: bool  # the plan's decision (trainer.offload): optimizer state off the device during rollout
    # Split placement's training ranks: the reward model they score with (None: none; colocated, every
    # source is the experience's).
    reward_model: Optional[Rewards] = None

    @property
    def trained(self) -> list[TrainEngine]:
        return [e for e in (self.actor, self.critic) if e is not None]


@dataclass(kw_only=True)
class ColocatedRun(RunCommon):
    training: Trainer
    experience: Experience  # its session exports the actor's weights into the engine

    def close(self) -> None:
        super().close()
        self.experience.close()


@dataclass(kw_only=True)
class TrainingRun(RunCommon):
    training: Trainer

    def close(self) -> None:
        super().close()
        if self.training.reward_model is not None:
            self.training.reward_model.close()


@dataclass(kw_only=True)
class RolloutRun(RunCommon):
    experience: Experience  # its session loads the weights the exchange receives

    def close(self) -> None:
        super().close()
        self.experience.close()


AnyRun = Union[ColocatedRun, TrainingRun, RolloutRun]
R = TypeVar("R", ColocatedRun, TrainingRun, RolloutRun)


def _trainer(cfg: Config, dims: ParallelDims, device: torch.device, total_steps: int, offload: bool,
             reward_model: Optional[Rewards]) -> Trainer:
    """Actor, reference (when a KL term uses it) and critic (when the estimator needs values)."""
    actor = build_engine(cfg, cfg.model.path, role="actor", dims=dims, device=device, total_steps=total_steps)
    need_ref = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    # A LoRA actor is its own reference with the adapters off: no second copy of the weights (as verl).
    ref = None
    if need_ref:
        ref = actor.base_reference() or build_engine(cfg, cfg.model.path, role="ref", dims=dims,
                                                     device=device)
    critic = None
    if ADVANTAGES.meta(cfg.algorithm.adv_estimator).get("needs_values"):
        critic = build_engine(cfg, cfg.critic.model_path or cfg.model.path, role="critic", dims=dims,
                              device=device, total_steps=total_steps)
    kc = cfg.algorithm.kl_ctrl
    return Trainer(actor=actor, ref=ref, critic=critic,
                   kl_ctrl=build_kl_controller(kc.type, kc.kl_coef, kc.target_kl, kc.horizon),
                   actor_loss=actor_loss_fn(cfg), critic_loss=critic_loss_fn(cfg), offload=offload,
                   reward_model=reward_model)


def build(user_cfg: Config, dims: ParallelDims, plan: Optional[Plan] = None) -> AnyRun:
    """Every component of this rank, in the order the collectives of their construction need; ``plan``'s
    decisions (the memory plan, made before any process group; made here when not given) apply."""
    from transformers import AutoTokenizer

    rank = dist.get_rank()
    role = dims.role(rank)
    device = device_for_rank(dims.device_type)
    torch.manual_seed(user_cfg.trainer.seed)
    rank_plan = plan or make_plans(user_cfg, dims.world_size, int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                                   dims.device_type)[role]
    cfg = resolve_builtins(rank_plan.apply(user_cfg))
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
    # A training rank still reads the data's length, so both roles of a split placement count the same steps.
    rollout_rank = rollout_coords(dims.rollout_mesh)[0] if role.generates else 0
    train_loader, val_loader = build_loaders(cfg, tokenizer, rank=rollout_rank, world_size=dims.rollout_dp)
    # A user's reward file is imported here, so its errors stop the run before the models load. Under split
    # placement the training ranks hold the reward model (reward.sources).
    rewards = build_rewards(cfg, dims, device, tokenizer, role)
    total_steps = cfg.trainer.total_steps or cfg.trainer.total_epochs * train_loader.steps_per_epoch
    precision, emulated = precision_summary(cfg.actor.param_dtype, cfg.rollout.dtype, device.type)
    if emulated and rank == 0:
        log.warning("bfloat16 was asked for but this %s has no native bf16: bf16 matmuls are emulated, %s; "
                    "the default (auto) picks float32 here", device.type.upper(), EMULATED_BF16_SLOWDOWN)
    trainer = None
    if role.trains:
        trainer = _trainer(cfg, dims, device, total_steps, rank_plan.offload,
                           rewards if role is RankRole.TRAINING else None)
    else:  # split placement's rollout ranks: their part in the world-wide steps of the engines' construction
        engine_class(cfg.actor.strategy).join_as_bystander(dims)
    # When it fires it names the stalled rank's role (split placement).
    watchdog = Watchdog(cfg.trainer.hang_timeout_s, rank, dims.world_size, role.label)
    timer = PhaseTimer(device, on_phase=watchdog.beat, exact_memory=cfg.trainer.exact_memory)

    def run(cls: type[R], **sides: Any) -> R:
        return cls(cfg=cfg, config_text=dump_config(user_cfg), dims=dims, role=role, device=device, rank=rank,
                   out_dir=output_dir(cfg), tokenizer=tokenizer, train_loader=train_loader,
                   val_loader=val_loader, validation=Validation.of(cfg.trainer, val_loader is not None),
                   timer=timer, watchdog=watchdog, total_steps=total_steps, plan=rank_plan, **sides)

    model = f"actor {trainer.actor.num_params() / 1e6:.2f}M params" if trainer else "rollout engine"
    print(_summary(rank, dims, device, cfg.model.path, model, precision), flush=True)
    if trainer is not None and not role.generates:
        return run(TrainingRun, training=trainer)
    assert rewards is not None  # the rollout ranks' sources (colocated: every source)
    if trainer is None:  # split placement: the weights come from the exchange (spmdrl/split/)
        return run(RolloutRun, experience=Experience.from_config(cfg, dims, device, tokenizer, rewards, timer,
                                                                 export_weights=None))
    actor = trainer.actor
    # Exported in the rollout's dtype: the cast happens before the gather, half the bytes for bf16.
    rollout_dtype = resolve_dtype(cfg.rollout.dtype, device.type)
    experience = Experience.from_config(cfg, dims, device, tokenizer, rewards, timer,
                                        export_weights=lambda: actor.export_weights(rollout_dtype))
    return run(ColocatedRun, training=trainer, experience=experience)


def _summary(rank: int, dims: ParallelDims, device: torch.device, model_path: str, model: str,
             precision: str) -> str:
    c = dims.coords(rank)
    train = (f"train mesh pp={c['pp']} dp_replicate={c['dp_replicate']} dp_shard={c['dp_shard']} "
             f"sp={c['sp']} tp={c['tp']}" if dims.trains(rank) else "rollout only")
    rollout = (f"rollout mesh dp={c['rollout_dp']} tp={c['rollout_tp']}" if dims.generates(rank)
               else "training only")
    return f"[rank {rank}/{dims.world_size}] {train} | {rollout} | device {device} | {model} from " \
           f"{model_path} | {precision}"
