"""Advantage estimators: token rewards (+ values or a baseline) -> advantages and returns.

Every estimator has the same keyword signature, so the loop calls whichever the
config names without branching on it:

    fn = get_advantage(cfg.algorithm.adv_estimator)
    needs = ADVANTAGES.meta(cfg.algorithm.adv_estimator)   # needs_values / needs_baseline
    adv, ret = fn(token_rewards, response_mask, index, values=values, baseline=None,
                  gamma=..., lam=..., norm_adv_by_std_in_grpo=..., epsilon=1e-6, group=dp_group)

Arguments an estimator does not use are ignored. ``index`` [B] is the prompt
id: the responses of one prompt form a group. Groups are rank-local (all
responses of a prompt live on one rank); only batch-wide statistics (whitening,
GPG's batch size and non-zero count) are all-reduced over ``group``.

Both outputs are zero where ``response_mask`` is 0. A group of one response has
baseline 0 in every group estimator (as in verl), so its advantage is its raw
score rather than a meaningless 0. The functions run under ``torch.no_grad``:
advantages are targets, never differentiated.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from spmdrl.algos.registry import register_advantage
from spmdrl.algos.utils import all_reduce_sum, masked_whiten

AdvOut = tuple[torch.Tensor, torch.Tensor]


def _groups(index: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Dense group ids 0..G-1 for arbitrary prompt ids."""
    _, gid = torch.unique(index, return_inverse=True)  # [B]
    return gid, int(gid.max().item()) + 1 if gid.numel() else 0


def _group_sum(x: torch.Tensor, gid: torch.Tensor, num_groups: int) -> torch.Tensor:
    return torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(0, gid, x)  # [G]


def _group_mean_std(
    scores: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-response group mean, unbiased group std and group size; a group of one gets mean 0, std 1."""
    gid, num_groups = _groups(index)
    count = _group_sum(torch.ones_like(scores), gid, num_groups)  # [G]
    mean = _group_sum(scores, gid, num_groups) / count  # [G]
    sq_dev = _group_sum((scores - mean[gid]) ** 2, gid, num_groups)  # [G]
    std = (sq_dev / (count - 1).clamp(min=1)).sqrt()  # [G]
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[gid], std[gid], count[gid]  # each [B]


def _seq_scores(token_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (token_rewards * mask).sum(-1)  # [B]


def _broadcast(per_seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return per_seq.unsqueeze(-1) * mask  # [B, T]


def _reverse_cumsum(x: torch.Tensor) -> torch.Tensor:
    return x.flip(-1).cumsum(-1).flip(-1)  # [B, T]


@register_advantage("gae", needs_values=True)
@torch.no_grad()
def gae(
    token_rewards: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T]
    index: torch.Tensor,  # [B]
    *,
    values: Optional[torch.Tensor] = None,  # [B, T]
    baseline: Optional[torch.Tensor] = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    group: Optional[dist.ProcessGroup] = None,
) -> AdvOut:
    """Generalised advantage estimation (PPO); returns = GAE + values before whitening.

    A masked position (padding, or tool/observation tokens inside a response)
    is skipped: it passes the next valid step's value and running advantage
    through unchanged, so the TD chain links the valid tokens around it.
    """
    if values is None:
        raise ValueError("advantage estimator 'gae' needs values from a critic (values=None was passed)")
    mask = response_mask.to(token_rewards.dtype)
    next_value = torch.zeros_like(token_rewards[:, 0])  # [B]
    last_gae = torch.zeros_like(token_rewards[:, 0])  # [B]
    adv = torch.zeros_like(token_rewards)  # [B, T]
    for t in reversed(range(token_rewards.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        m = mask[:, t]
        next_value = values[:, t] * m + next_value * (1 - m)
        last_gae = gae_t * m + last_gae * (1 - m)
        adv[:, t] = last_gae
    returns = (adv + values) * mask
    adv = masked_whiten(adv, mask, group=group) * mask
    return adv, returns


@register_advantage("grpo")
@torch.no_grad()
def grpo(
    token_rewards: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T]
    index: torch.Tensor,  # [B]
    *,
    values: Optional[torch.Tensor] = None,
    baseline: Optional[torch.Tensor] = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    group: Optional[dist.ProcessGroup] = None,
) -> AdvOut:
    """GRPO: (score - group mean) / (unbiased group std + epsilon); Dr.GRPO without the std division."""
    mask = response_mask.to(token_rewards.dtype)
    scores = _seq_scores(token_rewards, mask)  # [B]
    mean, std, _ = _group_mean_std(scores, index)
    adv = scores - mean
    if norm_adv_by_std_in_grpo:
        adv = adv / (std + epsilon)
    adv = _broadcast(adv, mask)
    return adv, adv


@register_advantage("rloo")
@torch.no_grad()
def rloo(
    token_rewards: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T]
    index: torch.Tensor,  # [B]
    *,
    values: Optional[torch.Tensor] = None,
    baseline: Optional[torch.Tensor] = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    group: Optional[dist.ProcessGroup] = None,
) -> AdvOut:
    """REINFORCE leave-one-out: s - mean of the other n-1 scores, i.e. (s - mean) * n / (n - 1)."""
    mask = response_mask.to(token_rewards.dtype)
    scores = _seq_scores(token_rewards, mask)  # [B]
    mean, _, n = _group_mean_std(scores, index)
    scale = n / (n - 1).clamp(min=1)
    adv = torch.where(n > 1, scores * scale - mean * scale, scores)
    adv = _broadcast(adv, mask)
    return adv, adv


@register_advantage("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus(
    token_rewards: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T]
    index: torch.Tensor,  # [B]
    *,
    values: Optional[torch.Tensor] = None,
    baseline: Optional[torch.Tensor] = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    group: Optional[dist.ProcessGroup] = None,
) -> AdvOut:
    """REINFORCE++: discounted return-to-go, whitened over the (global) batch; returns are unwhitened.

    A masked position (padding, or tool output inside a response) is skipped as
    in ``gae`` and verl: it carries the running return through unchanged, so a
    valid token before it sees the rewards of the valid tokens after it,
    discounted once per valid step.
    """
    mask = response_mask.to(token_rewards.dtype)
    returns = torch.zeros_like(token_rewards)  # [B, T]
    running = torch.zeros_like(token_rewards[:, 0])  # [B]
    for t in reversed(range(token_rewards.shape[1])):
        m = mask[:, t]
        new = (token_rewards[:, t] + gamma * running) * m
        returns[:, t] = new
        running = new + running * (1 - m)
    adv = masked_whiten(returns, mask, group=group) * mask
    return adv, returns


@register_advantage("reinforce_plus_plus_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline(
    token_rewards: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T]
    index: torch.Tensor,  # [B]
    *,
    values: Optional[torch.Tensor] = None,
    baseline: Optional[torch.Tensor] = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    group: Optional[dist.ProcessGroup] = None,
) -> AdvOut:
    """REINFORCE++ with a group-mean baseline: (s - group mean) on every token, whitened over the batch."""
    mask = response_mask.to(token_rewards.dtype)
    scores = _seq_scores(token_rewards, mask)  # [B]
    mean, _, _ = _group_mean_std(scores, index)
    adv = _broadcast(scores - mean, mask)  # [B, T]
    adv = masked_whiten(adv, mask, group=group) * mask
    return adv, adv


@register_advantage("remax", needs_baseline=True)
@torch.no_grad()
def remax(
    token_rewards: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T]
    index: torch.Tensor,  # [B]
    *,
    values: Optional[torch.Tensor] = None,
    baseline: Optional[torch.Tensor] = None,  # [B]
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    group: Optional[dist.ProcessGroup] = None,
) -> AdvOut:
    """ReMax: undiscounted return-to-go minus the reward of a greedy rollout of the same prompt."""
    if baseline is None:
        raise ValueError(
            "advantage estimator 'remax' needs baseline= the greedy-rollout reward per response (got None)"
        )
    mask = response_mask.to(token_rewards.dtype)
    returns = _reverse_cumsum(token_rewards * mask) * mask  # [B, T]
    adv = returns - _broadcast(baseline.to(returns.dtype), mask)
    return adv, returns


@register_advantage("gpg")
@torch.no_grad()
def gpg(
    token_rewards: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T]
    index: torch.Tensor,  # [B]
    *,
    values: Optional[torch.Tensor] = None,
    baseline: Optional[torch.Tensor] = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    group: Optional[dist.ProcessGroup] = None,
) -> AdvOut:
    """GPG: alpha * (s - group mean), alpha = global batch size / global count of non-zero scores (>= 1).

    alpha rescales the batch-mean gradient as if it averaged only the responses
    that carry a reward signal, so sparse rewards do not shrink the step.
    """
    mask = response_mask.to(token_rewards.dtype)
    scores = _seq_scores(token_rewards, mask)  # [B]
    mean, _, _ = _group_mean_std(scores, index)
    # [2]: batch size and non-zero scores, reduced in one collective
    counts = torch.stack([torch.ones_like(scores).sum(), (scores != 0).to(scores.dtype).sum()])
    counts = all_reduce_sum(counts, group)
    alpha = counts[0] / counts[1].clamp(min=1)
    adv = _broadcast(alpha * (scores - mean), mask)
    return adv, adv


@register_advantage("opo")
@torch.no_grad()
def opo(
    token_rewards: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T]
    index: torch.Tensor,  # [B]
    *,
    values: Optional[torch.Tensor] = None,
    baseline: Optional[torch.Tensor] = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    group: Optional[dist.ProcessGroup] = None,
) -> AdvOut:
    """OPO: s minus the length-weighted group mean of the scores (the variance-optimal baseline
    for a token-sum gradient, when gradient norms grow with response length)."""
    mask = response_mask.to(token_rewards.dtype)
    scores = _seq_scores(token_rewards, mask)  # [B]
    lengths = mask.sum(-1)  # [B]
    gid, num_groups = _groups(index)
    count = _group_sum(torch.ones_like(scores), gid, num_groups)  # [G]
    weighted = _group_sum(lengths * scores, gid, num_groups)  # [G]
    total_len = _group_sum(lengths, gid, num_groups)  # [G]
    base = torch.where(count > 1, weighted / total_len.clamp(min=1), torch.zeros_like(weighted))  # [G]
    adv = _broadcast(scores - base[gid], mask)
    return adv, adv
