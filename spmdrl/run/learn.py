"""The training side of a step, shared by the colocated loop and split placement's training ranks:

    balance -> old logp -> ref logp -> values -> advantages -> update (critic, actor)     (``learn``)
    -> metrics reduced over the ranks, the step's timing window closed                   (``finish_step``)

Every rank runs it on its own share of the scored batch. Batch-wide numbers (token counts, whitening, the
KL controller's rows, metrics) are all-reduced over the rank's batch group, so that one rank and k ranks
agree.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Optional

import torch
import torch.distributed as dist

from spmdrl.algos.kl import apply_kl_penalty
from spmdrl.algos.registry import get_advantage
from spmdrl.algos.rollout_correction import rollout_correction
from spmdrl.batch import Batch
from spmdrl.engines.balance import balance_rows, balance_slot
from spmdrl.experience import rollout_actor_gap, sampling_params
from spmdrl.metrics import reduce_metrics
from spmdrl.run.build import RunCommon, Trainer


def learn(r: RunCommon, tr: Trainer, batch: Batch, *, bypass: bool) -> tuple[dict[str, float], float]:
    """Everything a step does with a scored batch of this rank's share: balance, old / reference log-probs,
    values, advantages, then the critic's and the actor's updates; (its metrics, the tokens this rank
    trained on). ``bypass``: the PPO ratio is taken against the rollout's own log-probs
    (``rollout_correction.bypass_mode``; split placement's off-policy batches)."""
    cfg, t, metrics = r.cfg, r.timer, {}
    a, ref = cfg.actor, cfg.ref
    kept_mask, rc = None, cfg.algorithm.rollout_correction
    mini = _mini_rows(r, cfg.actor.ppo_mini_batch_size)  # the actor's rows per rank per optimizer step
    critic_mini = _mini_rows(r, cfg.critic.ppo_mini_batch_size)
    if cfg.trainer.balance_batch and r.batch_ranks > 1:
        with t.phase("balance"):
            # Groups move within slots inside one actor and one critic mini-batch: neither update changes.
            slot = balance_slot([mini, critic_mini] if tr.critic is not None else [mini])
            batch, balance = balance_rows(batch, cfg.rollout.n, slot, r.group, r.device)
        metrics.update(balance)
    # One on-policy pass: the loss uses the detached current log-probs and measures the rollout gap from
    # its own forward (objectives.py), unless something before the update needs the actor's log-probs.
    one_pass = cfg.actor.ppo_epochs == 1 and mini >= len(batch)
    with t.phase("old_logp"):
        if bypass:  # the PPO ratio is taken against the rollout policy itself
            batch["old_logp"] = batch["rollout_logp"]
        elif not one_pass or cfg.algorithm.use_kl_in_reward or rc.corrects or a.router_replay == "R2":
            old = tr.actor.forward_no_grad(
                batch, cfg.actor.log_prob_micro_batch_size_per_gpu,
                max_token_len=_budget(a.log_prob_use_dynamic_bsz, a.log_prob_max_token_len_per_gpu),
            )
            batch["old_logp"] = old["logp"]
            if "routed_experts" in old:  # R2: the update replays this pass's routing
                batch["routed_experts"] = old["routed_experts"]
            metrics.update(rollout_actor_gap(batch, sampling_params(cfg)))
            if "rollout_logp" in batch:  # rollout.calculate_log_probs: verl's default leaves them out
                kept_mask, corr_metrics = _rollout_correction(r, batch)
                metrics.update(corr_metrics)
    with t.phase("ref"):
        if tr.ref is not None:
            batch["ref_logp"] = tr.ref.forward_no_grad(
                batch, cfg.ref.log_prob_micro_batch_size_per_gpu,
                max_token_len=_budget(ref.log_prob_use_dynamic_bsz, ref.log_prob_max_token_len_per_gpu),
            )["logp"]
    with t.phase("values"):
        if tr.critic is not None:
            batch["values"] = tr.critic.forward_no_grad(
                batch, cfg.critic.ppo_micro_batch_size_per_gpu,
                max_token_len=_budget(cfg.critic.use_dynamic_bsz, cfg.critic.forward_max_token_len_per_gpu),
            )["values"]
    with t.phase("adv"):
        metrics.update(_advantages(r, tr, batch))
    if kept_mask is not None:  # rejected tokens leave the losses, after advantages saw whole responses
        batch["response_mask"] = kept_mask
    with t.phase("update"):
        if tr.critic is not None:
            c = cfg.critic
            metrics.update(tr.critic.train_step(
                batch, tr.critic_loss, critic_mini, c.ppo_micro_batch_size_per_gpu, c.ppo_epochs,
                max_token_len=_budget(c.use_dynamic_bsz, c.ppo_max_token_len_per_gpu)))
        metrics.update(tr.actor.train_step(
            batch, tr.actor_loss, mini, cfg.actor.ppo_micro_batch_size_per_gpu, cfg.actor.ppo_epochs,
            entropy_grad=cfg.actor.entropy_coeff != 0,
            max_token_len=_budget(a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu)))
    return metrics, float(batch["attention_mask"].sum())


def finish_step(r: RunCommon, metrics: dict[str, float], tokens: float) -> dict[str, float]:
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


def _budget(use_dynamic_bsz: bool, max_token_len: int) -> Optional[int]:
    """An engine's micro-batch token budget: ``max_token_len`` under use_dynamic_bsz, else None (by rows)."""
    return max_token_len if use_dynamic_bsz else None


def _mini_rows(r: RunCommon, ppo_mini_batch_size: int) -> int:
    """Rows per rank of one optimizer step: ``ppo_mini_batch_size`` prompts x n over the batch's ranks."""
    return ppo_mini_batch_size * r.cfg.rollout.n // r.batch_ranks


def _rollout_correction(r: RunCommon, batch: Batch) -> tuple[Optional[torch.Tensor], dict[str, float]]:
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


def _advantages(r: RunCommon, tr: Trainer, batch: Batch) -> dict[str, float]:
    """``advantages`` and ``returns`` [N, R] into ``batch``, after the in-reward KL penalty when it is on."""
    alg, metrics = r.cfg.algorithm, dict[str, float]()
    token_rewards, mask = batch["token_rewards"], batch["response_mask"]  # [N, R]
    if alg.use_kl_in_reward:
        token_rewards, metrics = apply_kl_penalty(
            token_rewards, batch["old_logp"], batch["ref_logp"], mask, kl_coef=tr.kl_ctrl.value,
            kl_penalty=alg.kl_penalty, group=r.group,
        )
        # As verl: the controller advances by the number of responses (prompts x n) in the batch.
        tr.kl_ctrl.update(metrics["actor/reward_kl_penalty"], n_steps=_global_rows(r, batch))
    adv, returns = get_advantage(alg.adv_estimator)(
        token_rewards, mask, batch["index"], values=batch.get("values"), baseline=batch.get("baseline"),
        gamma=alg.gamma, lam=alg.lam, norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo, group=r.group,
    )
    batch["advantages"], batch["returns"] = adv, returns
    return metrics


def _reduce(r: RunCommon, metrics: dict[str, float], tokens: float) -> dict[str, float]:
    """Metrics over ranks, each rank's peak memory, and the world's throughput."""
    peaks = _gather_float(metrics["memory/overall_peak_gb"], r.group)
    trained = sum(_gather_float(tokens, r.group))  # ranks hold different tokens (not rank 0's x the world)
    metrics = reduce_metrics(metrics, r.group)
    metrics.update({f"memory/rank{i}_overall_peak_gb": p for i, p in enumerate(peaks)})
    # Throughput is a world-wide sum: every rank's tokens over the slowest rank's step time.
    metrics["perf/tokens_per_s"] = trained / metrics["timing/step"]
    return metrics


def _global_rows(r: RunCommon, batch: Batch) -> int:
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
