"""The training loop every rank runs: one readable step, phases named and timed.

    prompts -> experience (weight sync, rollout, reward) -> old logp -> ref logp -> values
            -> advantages -> update (critic, actor) -> metrics, checkpoint, validation

Every rank runs exactly this code on its own share of the batch (docs/design.md).
Components are built by name from the config (engines, rollout engine, reward
sources, estimator, losses); nothing below branches on a backend. Experience
(generation and scoring, DAPO's rounds, ReMax's baseline) is produced below the
loop by ``spmdrl.experience``, which validation shares. Batch-wide numbers
(reward means, token counts, whitening) are all-reduced so that one rank and k
ranks agree.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from spmdrl.algos.kl import apply_kl_penalty, build_kl_controller
from spmdrl.algos.registry import ADVANTAGES, get_advantage
from spmdrl.algos.rollout_correction import rollout_correction
from spmdrl.builtin import resolve_builtins
from spmdrl.checkpoint.manager import CheckpointManager
from spmdrl.checkpoint.preemption import Preemption
from spmdrl.checkpoint.rng import RNGState
from spmdrl.checkpoint.run_folder import set_aside_earlier_run
from spmdrl.checkpoint.watchdog import Watchdog
from spmdrl.config import Config, dump_config, output_dir
from spmdrl.data import PromptLoader, ValidationLoader, build_loaders
from spmdrl.engines import build_engine, engine_class
from spmdrl.engines.balance import balance_rows, balance_slot
from spmdrl.engines.base import LogProbSource, LossFn, TrainEngine
from spmdrl.experience import Experience, batch_metrics, rollout_actor_gap, sampling_params
from spmdrl.metrics import MetricsSink, PhaseTimer, reduce_metrics
from spmdrl.objectives import actor_loss_fn, critic_loss_fn
from spmdrl.parallel import ParallelDims, device_for_rank, rollout_coords
from spmdrl.plan import Plan, make_plans
from spmdrl.plot import plot_run
from spmdrl.precision import EMULATED_BF16_SLOWDOWN, precision_summary, resolve_dtype
from spmdrl.reward.sources import Rewards, build_rewards
from spmdrl.rollout.generations import dump_generations
from spmdrl.validation import validation_metrics

log = logging.getLogger("spmdrl")


@dataclass
class Run:
    """Everything one rank holds for a run; built once by ``build``."""

    cfg: Config  # ``builtin:`` paths resolved (spmdrl.builtin.resolve_builtins)
    config_text: str  # the config as the user gave it (config.yaml, checkpoints)
    dims: ParallelDims
    device: torch.device
    rank: int
    out_dir: Path
    tokenizer: Any
    train_loader: PromptLoader
    val_loader: Optional[ValidationLoader]
    experience: Optional[Experience]  # rollout session, agent, reward sources (None: a split training rank)
    actor: Optional[TrainEngine]  # None: a rollout rank under split placement (spmdrl/split.py)
    # A split placement's training ranks: the reward model they score with (None: none, or colocated,
    # where every source is the experience's).
    rewards: Optional[Rewards]
    ref: Optional[LogProbSource]
    critic: Optional[TrainEngine]
    kl_ctrl: Any
    timer: PhaseTimer  # each phase start is a heartbeat of ``watchdog``
    watchdog: Watchdog
    total_steps: int
    actor_loss: LossFn
    critic_loss: LossFn
    plan: Optional[Plan] = None  # the memory plan (spmdrl/plan) and its decisions
    step: int = 0

    @property
    def offload(self) -> bool:
        """The plan's decision (trainer.offload): optimizer state off the device while rollout runs."""
        return self.plan is not None and self.plan.offload

    @property
    def group(self) -> dist.ProcessGroup:
        """Batch-wide statistics reduce over every rank (the batch is sharded over the world)."""
        return self.dims.batch_group

    @property
    def trained(self) -> list[TrainEngine]:
        return [e for e in (self.actor, self.critic) if e is not None]

    @property
    def world(self) -> int:
        """Ranks the batch is sharded over (the world; under split placement, this rank's role's ranks)."""
        return dist.get_world_size(self.group)


def _engines(cfg: Config, dims: ParallelDims, device: torch.device, total_steps: int
             ) -> tuple[TrainEngine, Optional[LogProbSource], Optional[TrainEngine]]:
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
    return actor, ref, critic


def build(user_cfg: Config, dims: ParallelDims, plan: Optional[Plan] = None) -> Run:
    """Every component of this rank, in the order the collectives of their construction need; ``plan``'s
    decisions (the memory plan, made before any process group; made here when not given) apply."""
    from transformers import AutoTokenizer

    rank = dist.get_rank()
    device = device_for_rank(dims.device_type)
    torch.manual_seed(user_cfg.trainer.seed)
    plan = plan or make_plans(user_cfg, dims.world_size, int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                              dims.device_type)[dims.role(rank)]
    cfg = resolve_builtins(plan.apply(user_cfg))
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
    # Under split placement a rank either generates or trains (dims.generates / dims.trains); a training
    # rank still reads the data's length, so both roles count the same steps.
    generates, trains = dims.generates(rank), dims.trains(rank)
    rollout_rank = rollout_coords(dims.rollout_mesh)[0] if generates else 0
    train_loader, val_loader = build_loaders(cfg, tokenizer, rank=rollout_rank, world_size=dims.rollout_dp)
    # A user's reward file is imported here, so its errors stop the run before the models load. Under split
    # placement the training ranks hold the reward model (reward.sources).
    rewards = build_rewards(cfg, dims, device, tokenizer, dims.role(rank) or "all")
    total_steps = cfg.trainer.total_steps or cfg.trainer.total_epochs * train_loader.steps_per_epoch
    precision, emulated = precision_summary(cfg.actor.param_dtype, cfg.rollout.dtype, device.type)
    if emulated and rank == 0:
        log.warning("bfloat16 was asked for but this %s has no native bf16: bf16 matmuls are emulated, %s; "
                    "the default (auto) picks float32 here", device.type.upper(), EMULATED_BF16_SLOWDOWN)
    actor = ref = critic = None
    if trains:
        actor, ref, critic = _engines(cfg, dims, device, total_steps)
    else:  # split placement's rollout ranks: their part in the world-wide steps of the engines' construction
        engine_class(cfg.actor.strategy).join_as_bystander(dims)
    # When it fires it names the stalled rank's role (split placement).
    watchdog = Watchdog(cfg.trainer.hang_timeout_s, rank, dims.world_size, dims.role(rank))
    timer = PhaseTimer(device, on_phase=watchdog.beat, exact_memory=cfg.trainer.exact_memory)
    # Exported in the rollout's dtype: the cast happens before the gather, half the bytes for bf16.
    rollout_dtype = resolve_dtype(cfg.rollout.dtype, device.type)
    experience = None
    if generates:  # split placement: the weights come from the training ranks (spmdrl/split.py)
        experience = Experience.from_config(cfg, dims, device, tokenizer, rewards, timer,
                                            export_weights=lambda: actor.export_weights(rollout_dtype))
    print(_summary(rank, dims, device, cfg.model.path, actor, precision), flush=True)
    kc = cfg.algorithm.kl_ctrl
    return Run(
        cfg=cfg, config_text=dump_config(user_cfg), dims=dims, device=device, rank=rank,
        out_dir=output_dir(cfg), tokenizer=tokenizer, train_loader=train_loader, val_loader=val_loader,
        experience=experience, actor=actor, rewards=None if generates else rewards, ref=ref, critic=critic,
        kl_ctrl=build_kl_controller(kc.type, kc.kl_coef, kc.target_kl, kc.horizon), timer=timer,
        watchdog=watchdog,
        total_steps=total_steps, actor_loss=actor_loss_fn(cfg), critic_loss=critic_loss_fn(cfg),
        plan=plan,
    )


def _summary(rank: int, dims: ParallelDims, device: torch.device, model_path: str,
             actor: Optional[TrainEngine], precision: str) -> str:
    c = dims.coords(rank)
    train = (f"train mesh pp={c['pp']} dp_replicate={c['dp_replicate']} dp_shard={c['dp_shard']} tp={c['tp']}"
             if dims.trains(rank) else "rollout only")
    rollout = (f"rollout mesh dp={c['rollout_dp']} tp={c['rollout_tp']}" if dims.generates(rank)
               else "training only")
    model = f"actor {actor.num_params() / 1e6:.2f}M params" if actor is not None else "rollout engine"
    return f"[rank {rank}/{dims.world_size}] {train} | {rollout} | device {device} | {model} from " \
           f"{model_path} | {precision}"


def _budget(use_dynamic_bsz: bool, max_token_len: int) -> Optional[int]:
    """An engine's micro-batch token budget: ``max_token_len`` under use_dynamic_bsz, else None (by rows)."""
    return max_token_len if use_dynamic_bsz else None


def train_step(r: Run) -> tuple[dict[str, float], float]:
    """One GRPO/PPO step on this rank's share of the batch: (this rank's metrics, its tokens); every
    piece of work in a phase (``finish_step`` reduces them and closes the step's timing window)."""
    cfg, t = r.cfg, r.timer
    with t.phase("data"):
        prompts = next(r.train_loader)
    r.experience.step = r.step + 1  # the step this experience trains, part of its sampling keys
    if r.offload:  # the memory plan's decision: optimizer state and gradients leave while rollout runs
        with t.phase("offload"):
            for engine in r.trained:
                engine.offload()
    batch, metrics = r.experience.produce(prompts, more_prompts=r.train_loader)
    if r.offload:
        with t.phase("onload"):
            for engine in r.trained:
                engine.onload()
    if cfg.trainer.rollout_data_dir:  # verl's generation dump, in (prompt id, sample) order on rank 0
        with t.phase("dump"):
            folder = r.out_dir / cfg.trainer.rollout_data_dir
            dump_generations(batch, r.tokenizer, r.step + 1, folder, r.group)

    metrics.update(batch_metrics(batch))
    learned, tokens = learn(r, batch, bypass=cfg.algorithm.rollout_correction.bypass_mode)
    r.experience.session.actor_changed()
    return {**metrics, **learned}, tokens


def learn(r: Run, batch, *, bypass: bool) -> tuple[dict[str, float], float]:
    """Everything a step does with a scored batch of this rank's share: balance, old / reference log-probs,
    values, advantages, then the critic's and the actor's updates; (its metrics, the tokens this rank
    trained on). ``bypass``: the PPO ratio is taken against the rollout's own log-probs
    (``rollout_correction.bypass_mode``; split placement's off-policy batches)."""
    cfg, t, metrics = r.cfg, r.timer, {}
    a, ref = cfg.actor, cfg.ref
    kept_mask, rc = None, cfg.algorithm.rollout_correction
    mini = _mini_rows(r, cfg.actor.ppo_mini_batch_size)  # the actor's rows per rank per optimizer step
    critic_mini = _mini_rows(r, cfg.critic.ppo_mini_batch_size)
    if cfg.trainer.balance_batch and r.world > 1:
        with t.phase("balance"):
            # Groups move within slots inside one actor and one critic mini-batch: neither update changes.
            slot = balance_slot([mini, critic_mini] if r.critic is not None else [mini])
            batch, balance = balance_rows(batch, cfg.rollout.n, slot, r.group, r.device)
        metrics.update(balance)
    # One on-policy pass: the loss uses the detached current log-probs and measures the rollout gap from
    # its own forward (objectives.py), unless something before the update needs the actor's log-probs.
    one_pass = cfg.actor.ppo_epochs == 1 and mini >= len(batch)
    with t.phase("old_logp"):
        if bypass:  # the PPO ratio is taken against the rollout policy itself
            batch["old_logp"] = batch["rollout_logp"]
        elif not one_pass or cfg.algorithm.use_kl_in_reward or rc.corrects:
            batch["old_logp"] = r.actor.forward_no_grad(
                batch, cfg.actor.log_prob_micro_batch_size_per_gpu,
                max_token_len=_budget(a.log_prob_use_dynamic_bsz, a.log_prob_max_token_len_per_gpu),
            )["logp"]
            metrics.update(rollout_actor_gap(batch, sampling_params(cfg)))
            if "rollout_logp" in batch:  # rollout.calculate_log_probs: verl's default leaves them out
                kept_mask, corr_metrics = _rollout_correction(r, batch)
                metrics.update(corr_metrics)
    with t.phase("ref"):
        if r.ref is not None:
            batch["ref_logp"] = r.ref.forward_no_grad(
                batch, cfg.ref.log_prob_micro_batch_size_per_gpu,
                max_token_len=_budget(ref.log_prob_use_dynamic_bsz, ref.log_prob_max_token_len_per_gpu),
            )["logp"]
    with t.phase("values"):
        if r.critic is not None:
            batch["values"] = r.critic.forward_no_grad(
                batch, cfg.critic.ppo_micro_batch_size_per_gpu,
                max_token_len=_budget(cfg.critic.use_dynamic_bsz, cfg.critic.forward_max_token_len_per_gpu),
            )["values"]
    with t.phase("adv"):
        metrics.update(_advantages(r, batch))
    if kept_mask is not None:  # rejected tokens leave the losses, after advantages saw whole responses
        batch["response_mask"] = kept_mask
    with t.phase("update"):
        if r.critic is not None:
            c = cfg.critic
            metrics.update(r.critic.train_step(
                batch, r.critic_loss, critic_mini, c.ppo_micro_batch_size_per_gpu, c.ppo_epochs,
                max_token_len=_budget(c.use_dynamic_bsz, c.ppo_max_token_len_per_gpu)))
        metrics.update(r.actor.train_step(
            batch, r.actor_loss, mini, cfg.actor.ppo_micro_batch_size_per_gpu, cfg.actor.ppo_epochs,
            entropy_grad=cfg.actor.entropy_coeff != 0,
            max_token_len=_budget(a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu)))
    return metrics, float(batch["attention_mask"].sum())


def finish_step(r: Run, metrics: dict[str, float], tokens: float) -> dict[str, float]:
    """Close the step's timing window (``timing/step``, ``timing/other``: what no phase covered) and reduce
    the metrics over ranks; the reduction is timed as ``timing/metrics`` and counted in the step."""
    metrics.update(r.timer.pop())
    start = time.perf_counter()
    metrics = _reduce(r, metrics, tokens)
    reduce_s = time.perf_counter() - start
    metrics["timing/metrics"] = reduce_s
    metrics["timing/step"] += reduce_s
    r.timer.restart()  # the next window starts after the reduction
    return metrics


def _mini_rows(r: Run, ppo_mini_batch_size: int) -> int:
    """Rows per rank of one optimizer step: ``ppo_mini_batch_size`` prompts x n over the world."""
    return ppo_mini_batch_size * r.cfg.rollout.n // r.world


def _rollout_correction(r: Run, batch) -> tuple[Optional[torch.Tensor], dict[str, float]]:
    """Importance weights into ``batch`` and the mask without rejected tokens (None when nothing is
    rejected), with the rollout-vs-training diagnostics, which are left out when the rollout sampled from a
    truncated distribution (top-k / top-p: its log-probs are not the actor's to compare; the config refuses
    corrections then)."""
    rc = r.cfg.algorithm.rollout_correction
    if not rc.corrects and not sampling_params(r.cfg).full_distribution:
        return None, {}
    options = {k: v for k, v in asdict(rc).items() if k != "bypass_mode"}  # the function's keywords
    weights, kept, metrics = rollout_correction(
        batch["old_logp"], batch["rollout_logp"], batch["response_mask"], **options, group=r.group)
    if weights is not None:
        batch["rollout_is_weights"] = weights  # [N, R]
    rejects = rc.rollout_rs is not None or rc.rollout_token_veto_threshold is not None
    return (kept if rejects else None), metrics


def _advantages(r: Run, batch) -> dict[str, float]:
    """``advantages`` and ``returns`` [N, R] into ``batch``, after the in-reward KL penalty when it is on."""
    alg, metrics = r.cfg.algorithm, {}
    token_rewards, mask = batch["token_rewards"], batch["response_mask"]  # [N, R]
    if alg.use_kl_in_reward:
        token_rewards, metrics = apply_kl_penalty(
            token_rewards, batch["old_logp"], batch["ref_logp"], mask, kl_coef=r.kl_ctrl.value,
            kl_penalty=alg.kl_penalty, group=r.group,
        )
        # As verl: the controller advances by the number of responses (prompts x n) in the batch.
        r.kl_ctrl.update(metrics["actor/reward_kl_penalty"], n_steps=_global_rows(r, batch))
    adv, returns = get_advantage(alg.adv_estimator)(
        token_rewards, mask, batch["index"], values=batch.get("values"), baseline=batch.get("baseline"),
        gamma=alg.gamma, lam=alg.lam, norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo, group=r.group,
    )
    batch["advantages"], batch["returns"] = adv, returns
    return metrics


def _reduce(r: Run, metrics: dict[str, float], tokens: float) -> dict[str, float]:
    """Metrics over ranks, each rank's peak memory, and the world's throughput."""
    peaks = _gather_float(metrics["memory/overall_peak_gb"], r.group)
    trained = sum(_gather_float(tokens, r.group))  # ranks hold different tokens (not rank 0's x the world)
    metrics = reduce_metrics(metrics, r.group)
    metrics.update({f"memory/rank{i}_overall_peak_gb": p for i, p in enumerate(peaks)})
    # Throughput is a world-wide sum: every rank's tokens over the slowest rank's step time.
    metrics["perf/tokens_per_s"] = trained / metrics["timing/step"]
    return metrics


def _global_rows(r: Run, batch) -> int:
    """Responses in the whole batch (DAPO may keep fewer than train_batch_size x n)."""
    rows = torch.tensor([len(batch)], dtype=torch.int64)
    dist.all_reduce(rows, group=r.group)
    return int(rows.item())


def _gather_float(value: float, group: dist.ProcessGroup) -> list[float]:
    """One float from every rank of ``group``, in rank order."""
    out = torch.zeros(dist.get_world_size(group), dtype=torch.float64)
    out[dist.get_rank(group)] = value
    dist.all_reduce(out, group=group)
    return out.tolist()


def _step(r: Run, ckpt: CheckpointManager, sink: MetricsSink, preemption: Preemption) -> bool:
    """One training step and what follows it (validation, logging, checkpoint, figures); whether the run
    goes on. Logging, checkpoint and figures are phases of the next step's window."""
    cfg, t = r.cfg, r.timer
    metrics, tokens = train_step(r)
    r.step += 1
    warn_failures(r, r.step)
    # The data's total_epochs can run out first when DAPO's extra rounds drew more batches.
    last = r.step == r.total_steps or r.train_loader.exhausted
    if cfg.trainer.test_freq > 0 and (r.step % cfg.trainer.test_freq == 0 or last):
        with t.phase("validation"):
            metrics.update(validation_metrics(r.experience, r.val_loader))
    metrics = finish_step(r, metrics, tokens)
    with t.phase("log"):
        sink.log(r.step, metrics)
    # A preemption signal (SIGTERM/SIGUSR1) turns into a checkpoint at this step boundary, then exit.
    stop = preemption.stop_requested(r.step)
    if ckpt.due(r.step, last) or stop:
        with t.phase("checkpoint"):
            ckpt.save(r.step)
    plot_due(r, last or stop)
    if stop:
        log.warning("stopping after step %d on a preemption signal; resume picks up from here", r.step)
        return False
    if last:
        warn_epochs_used(r)
        return False
    return True


def plot_due(r: Run, final: bool) -> None:
    """Figures of metrics.jsonl into out_dir/plots every ``trainer.plot_freq`` steps and at the run's
    ``final`` step (rank 0; a failure only warns)."""
    f = r.cfg.trainer.plot_freq
    if r.rank == 0 and f > 0 and (r.step % f == 0 or final):
        with r.timer.phase("plot"):
            plot_run(r.out_dir)


def warn_epochs_used(r: Run) -> None:
    """The run ends before total_steps: the data's epochs ran out first (DAPO's extra rounds)."""
    if r.step < r.total_steps and r.rank == 0:
        log.warning("data.train_files' %d epoch(s) are used up after step %d of %d: dynamic sampling drew "
                    "extra generation batches (verl ends its epoch loop here too); set trainer.total_steps "
                    "to train on past the epochs", r.cfg.trainer.total_epochs, r.step, r.total_steps)


def open_output(r: Run, resumed: bool) -> MetricsSink:
    """The run folder on rank 0 (a fresh start sets an earlier run's files aside, never overwrites them;
    config.yaml and plan.json) and the metrics sink of every rank (rank 0 writes)."""
    cfg = r.cfg
    if r.rank == 0:
        r.out_dir.mkdir(parents=True, exist_ok=True)
        if not resumed:
            dump = cfg.trainer.rollout_data_dir
            set_aside_earlier_run(r.out_dir, also=(Path(dump).parts[0],) if dump else ())
        (r.out_dir / "config.yaml").write_text(r.config_text)
        (r.out_dir / "plan.json").write_text(json.dumps(r.plan.summary(), indent=1) + "\n")
    return MetricsSink(r.out_dir, cfg.trainer.logger, r.total_steps, rank=r.rank,
                       progress_bar=cfg.trainer.progress_bar, project=cfg.trainer.project_name,
                       experiment=cfg.trainer.experiment_name, config=asdict(cfg), initial_step=r.step,
                       name=cfg.algorithm.adv_estimator)


def run(cfg: Config, dims: ParallelDims, plan: Optional[Plan] = None) -> None:
    r = build(cfg, dims, plan)
    preemption = Preemption()  # SIGTERM/SIGUSR1 handlers: checkpoint and stop at the next step boundary
    # What a checkpoint holds; each part declares how it is stored (spmdrl/checkpoint/manager.py).
    parts = {"actor": r.actor, "critic": r.critic, "data": r.train_loader, "kl_ctrl": r.kl_ctrl,
             "rng": RNGState(r.experience.session.engine, r.device, cfg.trainer.seed)}
    ckpt = CheckpointManager(r.out_dir, {k: v for k, v in parts.items() if v is not None}, cfg=r.cfg,
                             total_steps=r.total_steps, tokenizer=r.tokenizer, config_text=r.config_text)
    # trainer.resume: auto | off | PATH; restores engines, data, RNG and KL controller; returns the step.
    resumed = ckpt.resume()
    if resumed is not None:
        r.step = ckpt.resumed_step
        r.experience.session.actor_changed()  # the rollout engine still holds the initial weights
    sink = open_output(r, resumed is not None)
    try:
        # trainer.val_only (verl's): the initial or resumed weights' validation metrics, and no training.
        if cfg.trainer.val_only or (cfg.trainer.val_before_train and r.step == 0):
            sink.log(r.step, validation_metrics(r.experience, r.val_loader))
        r.timer.restart()  # the first step's window starts here
        while r.step < r.total_steps and not cfg.trainer.val_only and _step(r, ckpt, sink, preemption):
            pass
    finally:
        close(r, sink)
    end(r)


def warn_failures(r: Run, step: int) -> None:
    """Sporadic reward failures: the step trains on, with one line saying so (reward/num_errors counts
    them); a function failing on every response already stopped the run (Experience.score)."""
    failures = r.experience.pop_failures()
    if failures:
        log.warning("step %d: %d rewards failed on rank %d and scored 0 (first: %s)", step, len(failures),
                    r.rank, failures[0])


def close(r: Run, sink: MetricsSink) -> None:
    """What a run holds besides its engines: the watchdog, the metrics sink, the reward and tool workers."""
    r.watchdog.close()
    sink.close()
    if r.rewards is not None:
        r.rewards.close()
    if r.experience is not None:
        r.experience.rewards.close()
        if r.experience.agent is not None:
            r.experience.agent.close()


def end(r: Run) -> None:
    """Every rank is done with every collective; then the rollout engine may tear down what it started."""
    dist.barrier()
    if r.experience is not None:
        r.experience.session.engine.close()
