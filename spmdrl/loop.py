"""The training loop every rank runs: one readable step, phases named and timed.

    prompts -> weight sync -> rollout -> reward -> old logp -> ref logp -> values
            -> advantages -> update (critic, actor) -> metrics, checkpoint, validation

Every rank runs exactly this code on its own share of the batch (see
DESIGN.md). Components are built by name from the config (engines, rollout
engine, estimator, losses); nothing below branches on a backend. Batch-wide
numbers (reward means, token counts, whitening) are all-reduced so that one
rank and k ranks agree.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from spmdrl.agent.rollout import ToolAgent, annotate, multi_turn_metrics
from spmdrl.agent.tools import load_tool_config
from spmdrl.algos.dapo import filter_groups, overlong_penalty
from spmdrl.algos.kl import apply_kl_penalty, build_kl_controller
from spmdrl.algos.registry import ADVANTAGES, get_advantage
from spmdrl.batch import Batch, from_generation, place_scores
from spmdrl.config import Config, dump_config, output_dir
from spmdrl.engines import build_engine
from spmdrl.engines.base import LossFn, TrainEngine
from spmdrl.errors import ConfigError
from spmdrl.metrics import MetricsSink, PhaseTimer, reduce_metrics
from spmdrl.objectives import actor_loss_fn, critic_loss_fn
from spmdrl.parallel import ParallelDims, device_for_rank, rollout_coords, rollout_tp_rank
from spmdrl.plot import plot_run
from spmdrl.precision import EMULATED_BF16_SLOWDOWN, precision_summary, resolve_dtype
from spmdrl.reward.model import RewardModelScorer
from spmdrl.reward.rule import RewardManager, decode_responses
from spmdrl.rollout.base import SamplingParams, eos_ids_from_folder
from spmdrl.rollout import rollout_engine_class
from spmdrl.rollout.session import RolloutSession
from spmdrl.validation import validate

log = logging.getLogger("spmdrl")


@dataclass
class Run:
    """Everything one rank holds for a run; built once by ``build``."""

    cfg: Config
    dims: ParallelDims
    device: torch.device
    rank: int
    out_dir: Path
    tokenizer: object
    train_loader: object
    val_loader: Optional[object]
    rollout: RolloutSession  # the engine and the one owner of its wake/load/generate/sleep order
    actor: TrainEngine
    ref: Optional[TrainEngine]
    critic: Optional[TrainEngine]
    reward: RewardManager
    kl_ctrl: object
    timer: PhaseTimer
    total_steps: int
    actor_loss: LossFn
    critic_loss: LossFn
    rm: Optional[RewardModelScorer] = None  # reward_model.enable: the model-based reward
    step: int = 0
    agent: Optional[ToolAgent] = None  # multi-turn rollouts with tools (rollout.multi_turn.enable)

    @property
    def group(self) -> dist.ProcessGroup:
        """Batch-wide statistics reduce over every rank (the batch is sharded over the world)."""
        return self.dims.batch_group

    @property
    def trained(self) -> list[TrainEngine]:
        return [e for e in (self.actor, self.critic) if e is not None]


def build(cfg: Config, dims: ParallelDims) -> Run:
    from transformers import AutoTokenizer

    from spmdrl.data import build_train_loader, build_val_loader
    from spmdrl.builtin.models import resolve_builtin_model

    rank = dist.get_rank()
    device = device_for_rank(dims.device_type)
    torch.manual_seed(cfg.trainer.seed)
    model_path = resolve_builtin_model(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or model_path)
    rollout_rank, _ = rollout_coords(dims.rollout_mesh)
    mt = cfg.rollout.multi_turn
    tools = [s.tool_schema for s in load_tool_config(mt.tool_config_path)] if mt.enable else None
    try:
        train_loader = build_train_loader(cfg.data, tokenizer, rank=rollout_rank, world_size=dims.rollout_dp,
                                          seed=cfg.trainer.seed, tools=tools)
        val_loader = build_val_loader(cfg.data, tokenizer, rank=rollout_rank, world_size=dims.rollout_dp,
                                      tools=tools)
        reward = RewardManager.from_config(cfg.reward)
    except (ValueError, FileNotFoundError, ImportError, AttributeError) as err:
        raise ConfigError(str(err)) from err
    total_steps = cfg.trainer.total_steps or cfg.trainer.total_epochs * train_loader.steps_per_epoch

    precision, emulated = precision_summary(cfg.actor.param_dtype, cfg.rollout.dtype, device.type)
    if emulated and rank == 0:
        log.warning("bfloat16 was asked for but this %s has no native bf16: bf16 matmuls are emulated, %s; "
                    "the default (auto) picks float32 here", device.type.upper(), EMULATED_BF16_SLOWDOWN)
    adv_meta = ADVANTAGES.meta(cfg.algorithm.adv_estimator)
    actor = build_engine(cfg, model_path, role="actor", dims=dims, device=device, total_steps=total_steps)
    need_ref = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    ref = build_engine(cfg, model_path, role="ref", dims=dims, device=device) if need_ref else None
    critic = None
    if adv_meta.get("needs_values"):
        critic_path = resolve_builtin_model(cfg.critic.model_path or cfg.model.path)
        critic = build_engine(cfg, critic_path, role="critic", dims=dims, device=device, total_steps=total_steps)
    eos_ids = eos_ids_from_folder(model_path, tokenizer.eos_token_id)
    engine = rollout_engine_class(cfg.rollout.engine).from_config(
        cfg, model_path, mesh=dims.rollout_mesh, device=device, pad_token_id=tokenizer.pad_token_id or 0,
        eos_token_ids=eos_ids,
    )
    agent = ToolAgent.from_config(cfg, tokenizer, eos_ids) if cfg.rollout.multi_turn.enable else None
    # Exported in the rollout's dtype: the cast happens before the gather, half the bytes for bf16.
    rollout_dtype = resolve_dtype(cfg.rollout.dtype, device.type)
    # Colocated, the engine sleeps after each awake window unless rollout.free_cache_engine keeps it awake.
    session = RolloutSession(engine, lambda: actor.export_weights(rollout_dtype),
                             sleep_level=cfg.rollout.sleep_level,
                             colocate=cfg.trainer.colocate and cfg.rollout.free_cache_engine,
                             tp_rank=rollout_tp_rank(dims.rollout_mesh), tp=dims.rollout_tp)
    try:
        rm = RewardModelScorer.from_config(cfg, dims, device) if cfg.reward_model.enable else None
    except ValueError as err:
        raise ConfigError(str(err)) from err
    print(_summary(rank, dims, device, model_path, actor, precision), flush=True)
    kc = cfg.algorithm.kl_ctrl
    out_dir = output_dir(cfg)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(dump_config(cfg))
    return Run(
        cfg=cfg, dims=dims, device=device, rank=rank, out_dir=out_dir, tokenizer=tokenizer,
        train_loader=train_loader, val_loader=val_loader, rollout=session, actor=actor, ref=ref, critic=critic,
        reward=reward, kl_ctrl=build_kl_controller(kc.type, kc.kl_coef, kc.target_kl, kc.horizon),
        timer=PhaseTimer(device), total_steps=total_steps, actor_loss=actor_loss_fn(cfg),
        critic_loss=critic_loss_fn(cfg), agent=agent, rm=rm,
    )


def _summary(rank: int, dims: ParallelDims, device: torch.device, model_path: str, actor: TrainEngine,
             precision: str) -> str:
    c = dims.coords(rank)
    return (
        f"[rank {rank}/{dims.world_size}] train mesh pp={c['pp']} dp_replicate={c['dp_replicate']} "
        f"dp_shard={c['dp_shard']} tp={c['tp']} | rollout mesh dp={c['rollout_dp']} tp={c['rollout_tp']} | "
        f"device {device} | actor {actor.num_params() / 1e6:.2f}M params from {model_path} | {precision}"
    )


def sampling_params(cfg: Config, *, validation: bool = False) -> SamplingParams:
    r = cfg.rollout
    if validation:
        v = r.val_kwargs  # verl: do_sample false is greedy whatever the temperature
        return SamplingParams(n=v.n, max_tokens=cfg.data.max_response_length,
                              temperature=v.temperature if v.do_sample else 0.0, top_p=v.top_p, top_k=v.top_k)
    return SamplingParams(n=r.n, max_tokens=cfg.data.max_response_length, temperature=r.temperature,
                          top_p=r.top_p, top_k=r.top_k, ignore_eos=r.ignore_eos)


def generate(r: Run, prompts: list, sampling: SamplingParams) -> Batch:
    """Rollout of this rank's rollout-DP prompts; call inside ``r.rollout.awake()``. Under rollout TP the
    rank keeps its share of the TP group's responses (``RolloutSession.generate``)."""
    ids = [p.prompt_ids for p in prompts]
    if r.agent is not None:  # turns of the same engine calls, with tool output between them
        gen, trajectories = r.agent.generate(r.rollout.generate, ids, sampling, [p.extra_info for p in prompts],
                                             tool_phase=lambda: r.timer.phase("tools"))
    else:
        gen, trajectories = r.rollout.generate(ids, sampling), None
    batch = from_generation(gen, torch.tensor([p.index for p in prompts], dtype=torch.long))
    batch["rollout_logp"] = gen.logprobs  # [N, R] under the sampling distribution (rollout/sampling.py)
    per_row = gen.prompt_index.tolist()
    batch["data_source"] = [prompts[i].data_source for i in per_row]
    batch["ground_truth"] = [prompts[i].ground_truth for i in per_row]
    batch["extra_info"] = [prompts[i].extra_info for i in per_row]
    batch["chat"] = [prompts[i].chat for i in per_row]  # a reward model renders prompt + response itself
    batch["finish_reason"] = gen.finish_reasons
    if trajectories is not None:
        annotate(batch, trajectories)  # conversation and tool calls into extra_info; per-row tool counts
    return batch


def score(r: Run, batch: Batch, extras: Optional[dict[str, list]] = None) -> dict[str, float]:
    """Sequence scores (+ DAPO overlong shaping) into ``scores`` and ``token_rewards``; a scorer's per-response
    extra values (``acc``, ``pred``, ...) into ``extras`` when given (validation votes with them)."""
    R = batch["response_mask"].shape[1]
    # The whole response, tool output included (as verl decodes it); equal to the generated tokens single-turn.
    texts = decode_responses(r.tokenizer, batch["input_ids"][:, -R:], batch["attention_mask"][:, -R:])
    out = None
    if r.rm is None or r.rm.needs_rule:  # verl: a reward model's score replaces the rule score
        out = r.reward(batch["data_source"], texts, batch["ground_truth"], batch["extra_info"])
    scores = out.scores if out is not None else None  # [N]
    metrics = out.metrics() if out is not None else {}
    if r.rm is not None:  # collective: every rank scores every batch, even an empty share
        scores, rm_metrics = r.rm.score(batch["chat"], texts, scores)
        metrics.update(rm_metrics)
    scores = scores + batch.get("tool_reward", 0.0)  # tools' calc_reward, multi-turn only
    ob = r.cfg.reward.overlong_buffer
    if ob.enable:
        scores = scores + overlong_penalty(batch["response_mask"].sum(-1), max_response_length=r.cfg.data.max_response_length,
                                           buffer_len=ob.len, penalty_factor=ob.penalty_factor)
    batch["scores"] = scores
    batch["token_rewards"] = place_scores(scores, batch["response_mask"])
    extra = out.extra if out is not None else {}
    if extras is not None:
        extras.update(extra)
    for key, values in extra.items():  # e.g. a scorer's "acc", next to its "score"
        numbers = [float(v) for v in values if isinstance(v, (int, float, bool))]
        if numbers:
            metrics[f"reward/{key}"] = sum(numbers) / len(numbers)
    return metrics


def collect(r: Run, prompts: list) -> tuple[Batch, dict[str, float]]:
    """Rollout + reward (inside ``r.rollout.awake()``); with DAPO dynamic sampling, more prompts until every
    rank has its share of groups."""
    cfg, t = r.cfg, r.timer
    sampling = sampling_params(cfg)
    fg = cfg.algorithm.filter_groups
    want = len(prompts)  # groups this rank trains on
    kept: list[Batch] = []
    metrics: dict[str, float] = {}
    rounds = 0
    while True:
        rounds += 1
        with t.phase("rollout"):
            batch = generate(r, prompts, sampling)
        with t.phase("reward"):
            metrics.update(score(r, batch))
        if not fg.enable:
            return batch, metrics
        keep, counts = filter_groups(batch["scores"], batch["index"])
        kept.append(batch.select(keep.nonzero().squeeze(-1)))
        for k, v in counts.items():
            metrics[f"dapo/{k}"] = metrics.get(f"dapo/{k}", 0.0) + v
        have = torch.tensor([sum(len(b) for b in kept) // cfg.rollout.n], dtype=torch.long)
        dist.all_reduce(have, op=dist.ReduceOp.MIN)
        if have.item() >= want or (fg.max_num_gen_batches and rounds >= fg.max_num_gen_batches):
            break
        prompts = next(r.train_loader)
    metrics["dapo/num_gen_batches"] = float(rounds)
    # Every rank keeps the same number of whole groups so the update's collectives line up.
    groups = min(int(have.item()), want)
    if groups == 0:
        raise RuntimeError(
            f"dynamic sampling kept no group on some rank after {rounds} generation batches; raise "
            f"algorithm.filter_groups.max_num_gen_batches or make the task less all-or-nothing"
        )
    return Batch.cat(kept).select(slice(0, groups * cfg.rollout.n)), metrics


def train_step(r: Run) -> dict[str, float]:
    """One GRPO/PPO step on this rank's share of the batch; returns metrics reduced over ranks."""
    cfg, t = r.cfg, r.timer
    start = time.perf_counter()
    prompts = next(r.train_loader)

    alg = cfg.algorithm
    needs_baseline = ADVANTAGES.meta(alg.adv_estimator).get("needs_baseline")
    if cfg.trainer.colocate:  # optimizer state and gradients leave the device while rollout runs
        for engine in r.trained:
            engine.offload()
    with r.rollout.awake(lambda: t.phase("weight_sync")):
        batch, metrics = collect(r, prompts)
        baseline = _greedy_baseline(r, prompts, batch) if needs_baseline else None
    if cfg.trainer.colocate:
        for engine in r.trained:
            engine.onload()
    mask = batch["response_mask"]  # [N, R]
    rows = len(batch)
    mini = cfg.actor.ppo_mini_batch_size * cfg.rollout.n // r.dims.world_size  # rows per rank per optimizer step
    one_pass = cfg.actor.ppo_epochs == 1 and mini >= rows

    with t.phase("old_logp"):
        # On-policy with one optimizer step: the loss uses the detached current log-probs instead.
        if not one_pass or cfg.algorithm.use_kl_in_reward:
            batch["old_logp"] = r.actor.forward_no_grad(batch, cfg.actor.log_prob_micro_batch_size_per_gpu)["logp"]
            metrics.update(_rollout_actor_gap(batch, sampling_params(cfg)))
    with t.phase("ref"):
        if r.ref is not None:
            batch["ref_logp"] = r.ref.forward_no_grad(batch, cfg.ref.log_prob_micro_batch_size_per_gpu)["logp"]
    with t.phase("values"):
        if r.critic is not None:
            batch["values"] = r.critic.forward_no_grad(batch, cfg.critic.ppo_micro_batch_size_per_gpu)["values"]
    with t.phase("adv"):
        token_rewards = batch["token_rewards"]
        if alg.use_kl_in_reward:
            token_rewards, kl_metrics = apply_kl_penalty(
                token_rewards, batch["old_logp"], batch["ref_logp"], mask, kl_coef=r.kl_ctrl.value,
                kl_penalty=alg.kl_penalty, group=r.group,
            )
            # As verl: the controller advances by the number of responses (prompts x n) in the batch.
            r.kl_ctrl.update(kl_metrics["actor/reward_kl_penalty"], n_steps=_global_rows(r, batch))
            metrics.update(kl_metrics)
        adv, returns = get_advantage(alg.adv_estimator)(
            token_rewards, mask, batch["index"], values=batch.get("values"), baseline=baseline, gamma=alg.gamma,
            lam=alg.lam, norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo, group=r.group,
        )
        batch["advantages"], batch["returns"] = adv, returns
    with t.phase("update"):
        if r.critic is not None:
            c = cfg.critic
            metrics.update(r.critic.train_step(batch, r.critic_loss,
                                               c.ppo_mini_batch_size * cfg.rollout.n // r.dims.world_size,
                                               c.ppo_micro_batch_size_per_gpu, c.ppo_epochs))
        metrics.update(r.actor.train_step(batch, r.actor_loss, mini, cfg.actor.ppo_micro_batch_size_per_gpu,
                                          cfg.actor.ppo_epochs, entropy_grad=cfg.actor.entropy_coeff != 0))
        r.rollout.actor_changed()

    metrics.update(_batch_metrics(batch, cfg))
    metrics.update(t.pop())
    step_s = time.perf_counter() - start
    metrics["timing/step"] = step_s
    tokens = float(batch["attention_mask"].sum())
    peaks = _gather_float(metrics["memory/overall_peak_gb"])
    metrics = reduce_metrics(metrics, r.group)
    metrics.update({f"memory/rank{i}_overall_peak_gb": p for i, p in enumerate(peaks)})
    # Throughput is a world-wide sum: every rank's tokens over the slowest rank's step time.
    metrics["perf/tokens_per_s"] = tokens * r.dims.world_size / metrics["timing/step"]
    return metrics


def _rollout_actor_gap(batch: Batch, sampling: SamplingParams) -> dict[str, float]:
    """How far the rollout engine's log-probs are from the actor's recomputation of the same tokens (verl's
    training/rollout_probs_diff_*): a weight-sync or numerics check. Only comparable when the sampling
    distribution is the actor's full one (no top-k / top-p truncation; see rollout/sampling.py)."""
    if sampling.top_k > 0 or sampling.top_p < 1.0:
        return {}
    mask = batch["response_mask"].bool()  # [N, R]
    if not mask.any():
        return {}
    rollout, actor = batch["rollout_logp"][mask], batch["old_logp"][mask]  # [tokens]
    probs_diff = (rollout.exp() - actor.exp()).abs()
    return {
        "training/rollout_probs_diff/mean": float(probs_diff.mean()),
        "training/rollout_probs_diff/max": float(probs_diff.max()),
        "training/rollout_logp_diff/max": float((rollout - actor).abs().max()),
    }


def _global_rows(r: Run, batch: Batch) -> int:
    """Responses in the whole batch (DAPO may keep fewer than train_batch_size x n)."""
    rows = torch.tensor([len(batch)], dtype=torch.int64)
    dist.all_reduce(rows, group=r.group)
    return int(rows.item())


def _gather_float(value: float) -> list[float]:
    """One float from every rank, in rank order."""
    out = torch.zeros(dist.get_world_size(), dtype=torch.float64)
    out[dist.get_rank()] = value
    dist.all_reduce(out)
    return out.tolist()


def _greedy_baseline(r: Run, prompts: list, batch: Batch) -> torch.Tensor:
    """ReMax: the reward of a greedy response to each prompt, as the baseline of its samples (inside
    ``r.rollout.awake()``, timed with the rollout and reward phases)."""
    with r.timer.phase("rollout"):
        greedy = generate(r, prompts, SamplingParams(n=1, max_tokens=r.cfg.data.max_response_length,
                                                     temperature=0.0))
    with r.timer.phase("reward"):
        score(r, greedy)
    by_prompt = dict(zip(greedy["index"].tolist(), greedy["scores"].tolist()))
    return torch.tensor([by_prompt[i] for i in batch["index"].tolist()], dtype=torch.float32)  # [N]


def _batch_metrics(batch: Batch, cfg: Config) -> dict[str, float]:
    """Reward and length statistics of this rank's rows (means are averaged over ranks, max/min reduced)."""
    scores = batch["scores"]
    lengths = batch["response_mask"].sum(-1)
    clipped = torch.tensor([f == "length" for f in batch["finish_reason"]], dtype=torch.float32)
    return {
        "reward/mean": float(scores.mean()),
        "reward/max": float(scores.max()),
        "reward/min": float(scores.min()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float(clipped.mean()),
        "batch/responses": float(len(batch)),
        **multi_turn_metrics(batch),
    }


def run(cfg: Config, dims: ParallelDims) -> None:
    from spmdrl.checkpoint.manager import CheckpointManager
    from spmdrl.checkpoint.preemption import Preemption
    from spmdrl.checkpoint.rng import RNGState

    r = build(cfg, dims)
    preemption = Preemption()  # SIGTERM/SIGUSR1 handlers: checkpoint and stop at the next step boundary
    # What a checkpoint holds; each part declares how it is stored (spmdrl/checkpoint/manager.py).
    parts = {"actor": r.actor, "critic": r.critic, "data": r.train_loader, "kl_ctrl": r.kl_ctrl,
             "rng": RNGState(r.rollout.engine, r.device, cfg.trainer.seed)}
    ckpt = CheckpointManager(r.out_dir, {k: v for k, v in parts.items() if v is not None}, cfg=cfg,
                             total_steps=r.total_steps, tokenizer=r.tokenizer)
    # trainer.resume: auto | off | PATH; restores engines, data, RNG and KL controller; returns the step.
    if ckpt.resume() is not None:
        r.step = ckpt.resumed_step
        r.rollout.actor_changed()  # the rollout engine still holds the initial weights
    sink = MetricsSink(r.out_dir, cfg.trainer.logger, r.total_steps, rank=r.rank,
                       progress_bar=cfg.trainer.progress_bar, project=cfg.trainer.project_name,
                       experiment=cfg.trainer.experiment_name, config=asdict(cfg), initial_step=r.step)
    try:
        # trainer.val_only (verl's): the initial or resumed weights' validation metrics, and no training.
        if cfg.trainer.val_only or (cfg.trainer.val_before_train and r.step == 0):
            sink.log(r.step, validate(r))
        while r.step < r.total_steps and not cfg.trainer.val_only:
            metrics = train_step(r)
            r.step += 1
            if cfg.trainer.test_freq > 0 and (r.step % cfg.trainer.test_freq == 0 or r.step == r.total_steps):
                metrics.update(validate(r))
            sink.log(r.step, metrics)
            # A preemption signal (SIGTERM/SIGUSR1) turns into a checkpoint at this step boundary, then exit.
            stop = preemption.stop_requested(r.step)
            if ckpt.due(r.step) or stop:
                ckpt.save(r.step)
            f = cfg.trainer.plot_freq
            if r.rank == 0 and f > 0 and (r.step % f == 0 or r.step == r.total_steps or stop):
                plot_run(r.out_dir)  # figures of metrics.jsonl into out_dir/plots; a failure only warns
            if stop:
                log.warning("stopping after step %d on a preemption signal; resume picks up from here", r.step)
                break
    finally:
        sink.close()
        r.reward.close()
        if r.agent is not None:
            r.agent.close()
    # Every rank is done with every collective; then the engine may tear down what it started.
    dist.barrier()
    r.rollout.engine.close()
