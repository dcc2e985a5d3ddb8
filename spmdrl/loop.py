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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from spmdrl.algos.dapo import filter_groups, overlong_penalty
from spmdrl.algos.kl import apply_kl_penalty, build_kl_controller
from spmdrl.algos.registry import ADVANTAGES, get_advantage
from spmdrl.batch import Batch, from_generation, place_scores
from spmdrl.cli import ConfigError, dump_config, output_dir
from spmdrl.config import Config
from spmdrl.engines import build_engine
from spmdrl.engines.base import LossFn
from spmdrl.metrics import MetricsSink, PhaseTimer, reduce_metrics
from spmdrl.objectives import actor_loss_fn, critic_loss_fn
from spmdrl.parallel import ParallelDims, device_for_rank
from spmdrl.rewards import RewardManager, decode_responses
from spmdrl.rollout.base import RolloutEngine, SamplingParams, build_rollout

log = logging.getLogger("spmdrl")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    rollout: RolloutEngine
    actor: object
    ref: Optional[object]
    critic: Optional[object]
    reward: RewardManager
    kl_ctrl: object
    timer: PhaseTimer
    total_steps: int
    actor_loss: LossFn
    critic_loss: LossFn
    step: int = 0
    rollout_in_sync: bool = True  # rollout engine holds the actor's current weights
    extra_state: dict = field(default_factory=dict)

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        """All ranks: the batch is sharded over the whole world in rollout order."""
        return None


def build(cfg: Config, dims: ParallelDims) -> Run:
    from transformers import AutoTokenizer

    from spmdrl.data import build_train_loader, build_val_loader
    from spmdrl.tools.tiny_model import resolve_builtin_model

    rank, world = dist.get_rank(), dist.get_world_size()
    device = device_for_rank(dims.device_type)
    torch.manual_seed(cfg.trainer.seed)
    model_path = resolve_builtin_model(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or model_path)
    rollout_rank, rollout_world = dims.rollout_mesh.get_coordinate()[0], dims.rollout_dp
    try:
        train_loader = build_train_loader(cfg.data, tokenizer, rank=rollout_rank, world_size=rollout_world,
                                          seed=cfg.trainer.seed)
        val_loader = build_val_loader(cfg.data, tokenizer, rank=rollout_rank, world_size=rollout_world)
        reward = RewardManager.from_config(cfg.reward)
    except (ValueError, FileNotFoundError, ImportError, AttributeError) as err:
        raise ConfigError(str(err)) from err
    total_steps = cfg.trainer.total_steps or cfg.trainer.total_epochs * train_loader.steps_per_epoch

    adv_meta = ADVANTAGES.meta(cfg.algorithm.adv_estimator)
    actor = build_engine(cfg, model_path, role="actor", dims=dims, device=device, total_steps=total_steps)
    need_ref = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    ref = build_engine(cfg, model_path, role="ref", dims=dims, device=device) if need_ref else None
    critic = None
    if adv_meta.get("needs_values"):
        critic_path = resolve_builtin_model(cfg.critic.model_path or cfg.model.path)
        critic = build_engine(cfg, critic_path, role="critic", dims=dims, device=device, total_steps=total_steps)
    rollout = build_rollout(
        cfg.rollout.engine, model_path, mesh=dims.rollout_mesh, device=device, dtype=DTYPES[cfg.rollout.dtype],
        max_num_seqs=cfg.rollout.max_num_seqs, seed=cfg.trainer.seed * 1000 + rollout_rank,
        eos_token_ids=_eos_ids(tokenizer, model_path), pad_token_id=tokenizer.pad_token_id or 0,
        **({"kernels": cfg.rollout.native_kernels} if cfg.rollout.engine == "native" else {}),
    )
    print(_summary(rank, dims, device, model_path, actor), flush=True)
    kc = cfg.algorithm.kl_ctrl
    out_dir = output_dir(cfg)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(dump_config(cfg))
    return Run(
        cfg=cfg, dims=dims, device=device, rank=rank, out_dir=out_dir, tokenizer=tokenizer,
        train_loader=train_loader, val_loader=val_loader, rollout=rollout, actor=actor, ref=ref, critic=critic,
        reward=reward, kl_ctrl=build_kl_controller(kc.type, kc.kl_coef, kc.target_kl, kc.horizon),
        timer=PhaseTimer(device), total_steps=total_steps, actor_loss=actor_loss_fn(cfg),
        critic_loss=critic_loss_fn(cfg),
    )


def _summary(rank: int, dims: ParallelDims, device: torch.device, model_path: str, actor) -> str:
    c = dims.coords(rank)
    return (
        f"[rank {rank}/{dims.world_size}] train mesh pp={c['pp']} dp_replicate={c['dp_replicate']} "
        f"dp_shard={c['dp_shard']} tp={c['tp']} | rollout mesh dp={c['rollout_dp']} tp={c['rollout_tp']} | "
        f"device {device} | actor {actor.num_params() / 1e6:.2f}M params from {model_path}"
    )


def _eos_ids(tokenizer, model_path: str) -> list[int]:
    from transformers import GenerationConfig

    ids = {tokenizer.eos_token_id}
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos])
    except OSError:  # no generation_config.json: the tokenizer's EOS alone
        pass
    return sorted(i for i in ids if i is not None)


def sampling_params(cfg: Config, *, validation: bool = False) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(
        n=r.val_n if validation else r.n,
        max_tokens=cfg.data.max_response_length,
        temperature=r.val_temperature if validation else r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        ignore_eos=r.ignore_eos and not validation,
    )


def generate(r: Run, prompts: list, sampling: SamplingParams) -> Batch:
    """Rollout of this rank's prompts; the engine wakes for it and sleeps after when colocated."""
    r.rollout.wake_up(("kv_cache",))
    gen = r.rollout.generate([p.prompt_ids for p in prompts], sampling)
    if r.cfg.trainer.colocate:
        r.rollout.sleep(r.cfg.rollout.sleep_level)
    batch = from_generation(gen, torch.tensor([p.index for p in prompts], dtype=torch.long))
    per_row = gen.prompt_index.tolist()
    batch["data_source"] = [prompts[i].data_source for i in per_row]
    batch["ground_truth"] = [prompts[i].ground_truth for i in per_row]
    batch["extra_info"] = [prompts[i].extra_info for i in per_row]
    batch["finish_reason"] = gen.finish_reasons
    return batch


def score(r: Run, batch: Batch) -> dict[str, float]:
    """Sequence scores (+ DAPO overlong shaping) into ``scores`` and ``token_rewards``."""
    texts = decode_responses(r.tokenizer, batch["input_ids"][:, -batch["response_mask"].shape[1]:],
                             batch["response_mask"])
    out = r.reward(batch["data_source"], texts, batch["ground_truth"], batch["extra_info"])
    scores = out.scores  # [N]
    ob = r.cfg.reward.overlong_buffer
    if ob.enable:
        scores = scores + overlong_penalty(batch["response_mask"].sum(-1), max_response_length=r.cfg.data.max_response_length,
                                           buffer_len=ob.len, penalty_factor=ob.penalty_factor)
    batch["scores"] = scores
    batch["token_rewards"] = place_scores(scores, batch["response_mask"])
    metrics = out.metrics()
    for key, values in out.extra.items():  # e.g. a scorer's "acc", next to its "score"
        numbers = [float(v) for v in values if isinstance(v, (int, float, bool))]
        if numbers:
            metrics[f"reward/{key}"] = sum(numbers) / len(numbers)
    return metrics


def sync_weights(r: Run) -> None:
    """Push the actor's weights into the rollout engine when the actor changed since the last push."""
    r.rollout.wake_up(("weights",))
    if not r.rollout_in_sync:
        # Exported in the rollout's dtype: the cast happens before the gather, half the bytes for bf16.
        r.rollout.update_weights(r.actor.export_weights(getattr(torch, r.cfg.rollout.dtype)))
        r.rollout_in_sync = True


def collect(r: Run, prompts: list) -> tuple[Batch, dict[str, float]]:
    """Rollout + reward; with DAPO dynamic sampling, more prompts until every rank has its share of groups."""
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

    if cfg.trainer.colocate:
        r.actor.offload()
    with t.phase("weight_sync"):
        sync_weights(r)
    batch, metrics = collect(r, prompts)
    if cfg.trainer.colocate:
        r.actor.onload()
    mask = batch["response_mask"]  # [N, R]
    rows = len(batch)
    mini = cfg.actor.ppo_mini_batch_size * cfg.rollout.n // r.dims.world_size  # rows per rank per optimizer step
    one_pass = cfg.actor.ppo_epochs == 1 and mini >= rows

    with t.phase("old_logp"):
        # On-policy with one optimizer step: the loss uses the detached current log-probs instead.
        if not one_pass or cfg.algorithm.use_kl_in_reward:
            batch["old_logp"] = r.actor.forward_no_grad(batch, cfg.actor.log_prob_micro_batch_size_per_gpu)["logp"]
    with t.phase("ref"):
        if r.ref is not None:
            batch["ref_logp"] = r.ref.forward_no_grad(batch, cfg.ref.log_prob_micro_batch_size_per_gpu)["logp"]
    with t.phase("values"):
        if r.critic is not None:
            batch["values"] = r.critic.forward_no_grad(batch, cfg.critic.ppo_micro_batch_size_per_gpu)["values"]
    with t.phase("adv"):
        alg = cfg.algorithm
        token_rewards = batch["token_rewards"]
        if alg.use_kl_in_reward:
            token_rewards, kl_metrics = apply_kl_penalty(
                token_rewards, batch["old_logp"], batch["ref_logp"], mask, kl_coef=r.kl_ctrl.value,
                kl_penalty=alg.kl_penalty, group=r.group,
            )
            r.kl_ctrl.update(kl_metrics["actor/reward_kl_penalty"], n_steps=cfg.data.train_batch_size)
            metrics.update(kl_metrics)
        baseline = _greedy_baseline(r, prompts, batch) if ADVANTAGES.meta(alg.adv_estimator).get("needs_baseline") else None
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
        r.rollout_in_sync = False

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


def _gather_float(value: float) -> list[float]:
    """One float from every rank, in rank order."""
    out = torch.zeros(dist.get_world_size(), dtype=torch.float64)
    out[dist.get_rank()] = value
    dist.all_reduce(out)
    return out.tolist()


def _greedy_baseline(r: Run, prompts: list, batch: Batch) -> torch.Tensor:
    """ReMax: the reward of a greedy response to each prompt, as the baseline of its samples."""
    greedy = generate(r, prompts, SamplingParams(n=1, max_tokens=r.cfg.data.max_response_length, temperature=0.0))
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
    }


def validate(r: Run) -> dict[str, float]:
    """Greedy (``rollout.val_temperature``) responses to every validation prompt; mean score per data source."""
    if r.val_loader is None:
        return {}
    sums: dict[str, list[float]] = {}
    sync_weights(r)
    for prompts in r.val_loader:
        if prompts:
            batch = generate(r, prompts, sampling_params(r.cfg, validation=True))
            score(r, batch)
            for source, s in zip(batch["data_source"], batch["scores"].tolist()):
                acc = sums.setdefault(str(source), [0.0, 0.0])
                acc[0] += s
                acc[1] += 1
    # Ranks may have seen different sources; agree on the set, then sum.
    sources = [None] * dist.get_world_size()
    dist.all_gather_object(sources, sorted(sums))
    names = sorted({s for per in sources for s in per})
    totals = torch.tensor([sums.get(n, [0.0, 0.0]) for n in names], dtype=torch.float64).reshape(-1, 2)
    dist.all_reduce(totals)
    return {f"val/{n}/reward_mean": float(s / max(c, 1)) for n, (s, c) in zip(names, totals.tolist())}


def run(cfg: Config, dims: ParallelDims) -> None:
    from spmdrl.checkpoint import Checkpointer

    r = build(cfg, dims)
    ckpt = Checkpointer(r)
    ckpt.resume()  # trainer.resume: auto | off | PATH; restores step, engines, data, RNG, KL controller
    sink = MetricsSink(r.out_dir, cfg.trainer.logger, r.total_steps, rank=r.rank,
                       progress_bar=cfg.trainer.progress_bar, project=cfg.trainer.project_name,
                       experiment=cfg.trainer.experiment_name, initial_step=r.step)
    try:
        if cfg.trainer.val_before_train and r.step == 0:
            sink.log(r.step, validate(r))
        while r.step < r.total_steps:
            metrics = train_step(r)
            r.step += 1
            if cfg.trainer.test_freq > 0 and (r.step % cfg.trainer.test_freq == 0 or r.step == r.total_steps):
                metrics.update(validate(r))
            sink.log(r.step, metrics)
            # A preemption signal (SIGTERM/SIGUSR1) turns into a checkpoint at this step boundary, then exit.
            stop = ckpt.stop_requested()
            if ckpt.due(r.step) or stop:
                ckpt.save(r.step)
            if stop:
                log.warning("stopping after step %d on a preemption signal; resume picks up from here", r.step)
                break
    finally:
        sink.close()
        r.reward.close()
