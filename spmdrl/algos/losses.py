"""Token-loss aggregation, policy losses and the value loss.

A loss returns ``(loss, metrics)``. ``loss`` is this rank's *contribution*:
a sum over the local rows divided by a global denominator (``global_tokens``
or ``global_seqs`` from ``spmdrl.engines.base.LossScale``), so summing the
contributions of every micro-batch and every DP rank gives the mini-batch
loss, whatever the micro-batch size or DP degree. The engine multiplies by
``dp_size`` itself to undo FSDP's gradient averaging; nothing here does.
Without the global arguments the local counts are used, so a single batch
gives plain means. Metrics are shares (``utils.Share``) under the same global
denominators: the loss as aggregated, and the clip fractions and ppo_kl as
token means, so the engine's sum of them is the mini-batch's value.

Policy losses share one signature so the loop picks one by name:

    loss, metrics = get_policy_loss(cfg.actor.policy_loss)(
        logp, old_logp, advantages, mask, loss_agg_mode=..., clip_ratio_low=..., clip_ratio_high=...,
        clip_ratio_c=..., global_tokens=scale.global_tokens, global_seqs=scale.global_seqs, norm_len=...)
"""

from __future__ import annotations

from typing import Optional

import torch

from spmdrl.algos.registry import get_loss_agg, register_loss_agg, register_policy_loss
from spmdrl.algos.utils import Share

LossOut = tuple[torch.Tensor, dict[str, float]]

# Log-ratios are clamped before exp so one wildly off-policy token cannot make
# the ratio (or its gradient) overflow to inf and poison the step with NaN.
LOG_RATIO_CLAMP = 20.0
# GSPO clamps its combined token log-ratio (whose value is the sequence log-ratio)
# from above only, at 10, to match verl 0.9.1; no lower bound is needed, as exp
# of a very negative log-ratio underflows harmlessly to 0.
GSPO_LOG_RATIO_MAX = 10.0


def loss_denominators(mask: torch.Tensor) -> torch.Tensor:
    """The counts the aggregation modes divide by: [valid tokens, sequences] of ``mask`` [B, T], float64 [2].

    Every row is a sequence, a fully masked one included (a response rejected whole by
    ``algorithm.rollout_correction``, or an empty one): it adds 0 to a seq-mean numerator and 1 to its
    denominator, as in verl 0.9, whose trainer passes ``agg_loss`` the mini-batch's row count
    (``global_batch_size = ppo_mini_batch_size * rollout.n``). So rejecting responses shrinks the step
    instead of giving the kept ones more weight. The engine sums these over DP ranks into ``LossScale``
    (``global_tokens``, ``global_seqs``); ``agg_loss`` without them uses this micro-batch's.
    """
    tokens = mask.to(torch.float64).sum()
    return torch.stack([tokens, torch.full_like(tokens, mask.shape[0])])


def _denominator(mask: torch.Tensor, which: int, global_value: Optional[float]) -> torch.Tensor:
    """``loss_denominators``' count ``which`` (0: tokens, 1: sequences), or the global one when given."""
    if global_value is None:
        count = loss_denominators(mask)[which]
    else:
        count = torch.as_tensor(global_value, dtype=torch.float64, device=mask.device)
    # An empty micro-batch contributes 0 (its numerator is 0), not NaN.
    return count.to(mask.dtype).clamp(min=1)


@register_loss_agg("token-mean")
def _token_mean(
    loss_mat: torch.Tensor, mask: torch.Tensor, *, global_tokens: Optional[float] = None,
    global_seqs: Optional[float] = None, norm_len: Optional[float] = None,
) -> torch.Tensor:
    return (loss_mat * mask).sum() / _denominator(mask, 0, global_tokens)


@register_loss_agg("seq-mean-token-sum")
def _seq_mean_token_sum(
    loss_mat: torch.Tensor, mask: torch.Tensor, *, global_tokens: Optional[float] = None,
    global_seqs: Optional[float] = None, norm_len: Optional[float] = None,
) -> torch.Tensor:
    seq_loss = (loss_mat * mask).sum(-1)  # [B]
    return seq_loss.sum() / _denominator(mask, 1, global_seqs)


@register_loss_agg("seq-mean-token-mean")
def _seq_mean_token_mean(
    loss_mat: torch.Tensor, mask: torch.Tensor, *, global_tokens: Optional[float] = None,
    global_seqs: Optional[float] = None, norm_len: Optional[float] = None,
) -> torch.Tensor:
    seq_loss = (loss_mat * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [B]; empty rows give 0
    return seq_loss.sum() / _denominator(mask, 1, global_seqs)


@register_loss_agg("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(
    loss_mat: torch.Tensor, mask: torch.Tensor, *, global_tokens: Optional[float] = None,
    global_seqs: Optional[float] = None, norm_len: Optional[float] = None,
) -> torch.Tensor:
    length = float(mask.shape[-1]) if norm_len is None else float(norm_len)
    seq_loss = (loss_mat * mask).sum(-1) / length  # [B]
    return seq_loss.sum() / _denominator(mask, 1, global_seqs)


def agg_loss(
    loss_mat: torch.Tensor,  # [B, T]
    mask: torch.Tensor,  # [B, T]
    mode: str,
    *,
    global_tokens: Optional[float] = None,
    global_seqs: Optional[float] = None,
    norm_len: Optional[float] = None,
) -> torch.Tensor:
    """Reduce per-token losses to this rank's contribution to the mini-batch loss.

    ``mode`` (config key ``actor.loss_agg_mode``) decides how much each token weighs:

    - ``"token-mean"`` (default): sum of token losses / number of valid tokens
      in the global mini-batch (``global_tokens``). Every token weighs the same,
      so a long response weighs in proportion to its length; there is no
      per-sequence length normalisation and hence no bias towards short or long
      answers. Introduced by DAPO to remove GRPO's length bias.
    - ``"seq-mean-token-mean"``: each response's loss is its mean token loss,
      then the mean over responses (``global_seqs``). The original GRPO
      objective. Length-biased: a token of a short response weighs more than a
      token of a long one, so short correct answers are pushed up harder and
      long wrong answers are pushed down more weakly, which lets wrong answers
      grow long.
    - ``"seq-mean-token-sum"``: each response's loss is its token sum, then the
      mean over responses. Long responses dominate the gradient and its scale
      grows with length; a bias towards whatever long responses do.
    - ``"seq-mean-token-sum-norm"``: each response's token sum divided by a
      constant ``norm_len`` (the maximum response length, or
      ``actor.loss_scale_factor``), then the mean over responses. Dr. GRPO's
      fix: the constant is the same for every response, so there is no length
      bias, at the price of a gradient scale that shrinks when responses are
      much shorter than ``norm_len``. verl 0.9.1 (the seq-mean of
      seq-mean-token-sum, then divided by ``loss_scale_factor``) and TRL's
      ``dr_grpo`` also divide by the number of responses.

    The denominators default to the local counts when ``global_tokens`` /
    ``global_seqs`` are None; ``norm_len`` defaults to ``T``, the padded
    response length. Every row is a sequence, fully masked ones included
    (``loss_denominators``).
    """
    fn = get_loss_agg(mode)
    mask = mask.to(loss_mat.dtype)
    return fn(loss_mat, mask, global_tokens=global_tokens, global_seqs=global_seqs, norm_len=norm_len)


def token_share(x: torch.Tensor, mask: torch.Tensor, global_tokens: Optional[float]) -> Share:
    """The token mean of ``x`` [B, T] as this micro-batch's share of the mini-batch's (``utils.Share``)."""
    with torch.no_grad():
        mean = agg_loss(x.detach().to(mask.dtype), mask, "token-mean", global_tokens=global_tokens)
    return Share(mean.item())


def _pg_metrics(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    counts: dict,
    **token_means: torch.Tensor,
) -> dict[str, float]:
    """Shares of the mini-batch's metrics (``utils.Share``): the loss aggregated as the gradient's loss is
    (``counts``: global_tokens, global_seqs, norm_len), and token means of the given indicators."""
    with torch.no_grad():
        metrics: dict[str, float] = {"actor/pg_loss": Share(agg_loss(loss_mat, mask, mode, **counts).item())}
    for name, value in token_means.items():
        metrics[f"actor/{name}"] = token_share(value, mask, counts["global_tokens"])
    return metrics


@register_policy_loss("vanilla")
def vanilla_policy_loss(
    logp: torch.Tensor,  # [B, T]
    old_logp: torch.Tensor,  # [B, T]
    advantages: torch.Tensor,  # [B, T]
    mask: torch.Tensor,  # [B, T]
    *,
    loss_agg_mode: str = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    global_tokens: Optional[float] = None,
    global_seqs: Optional[float] = None,
    norm_len: Optional[float] = None,
) -> LossOut:
    """PPO clipped surrogate with asymmetric clip (DAPO clip-higher) and dual clip.

    The dual clip bounds the loss of a negative-advantage token at
    ``-A * clip_ratio_c``: PPO's clip does not bound ratio * |A| from above when
    A < 0, so a token that became much more likely could dominate the update.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (actor.clip_ratio_c), got {clip_ratio_c}")
    mask = mask.to(logp.dtype)
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -advantages * clip_ratio_c
    negative = advantages < 0
    loss_mat = torch.where(negative, torch.minimum(clipped, loss3), clipped)  # [B, T]
    counts = dict(global_tokens=global_tokens, global_seqs=global_seqs, norm_len=norm_len)
    loss = agg_loss(loss_mat, mask, loss_agg_mode, **counts)
    # ppo_kl from the clamped log-ratio, as verl reports it: a token past the clamp counts as +-20.
    metrics = _pg_metrics(loss_mat, mask, loss_agg_mode, counts, pg_clipfrac=loss2 > loss1,
                          pg_clipfrac_lower=(clipped > loss3) & negative, ppo_kl=-log_ratio)
    return loss, metrics


@register_policy_loss("gspo")
def gspo_policy_loss(
    logp: torch.Tensor,  # [B, T]
    old_logp: torch.Tensor,  # [B, T]
    advantages: torch.Tensor,  # [B, T]
    mask: torch.Tensor,  # [B, T]
    *,
    loss_agg_mode: str = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    global_tokens: Optional[float] = None,
    global_seqs: Optional[float] = None,
    norm_len: Optional[float] = None,
) -> LossOut:
    """GSPO: one importance ratio per response, exp(mean token log-ratio), clipped like PPO (no dual clip).

    Each token's ratio has the sequence ratio as its value and d/d logp_t = ratio,
    via ``logp_t - sg(logp_t) + sg(mean_t(logp - old_logp))``, clamped above at
    ``GSPO_LOG_RATIO_MAX`` as verl does. The token losses are aggregated with
    ``loss_agg_mode`` like every policy loss (GSPO's paper uses
    seq-mean-token-mean, which configs/gspo.yaml sets); ``clip_ratio_c`` is
    accepted for the uniform signature and ignored.
    """
    mask = mask.to(logp.dtype)
    log_ratio = logp - old_logp  # [B, T]
    seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
    token_log_ratio = logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1)  # [B, T]
    ratio = torch.exp(token_log_ratio.clamp(max=GSPO_LOG_RATIO_MAX))  # [B, T]
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    loss_mat = torch.maximum(loss1, loss2)  # [B, T]
    counts = dict(global_tokens=global_tokens, global_seqs=global_seqs, norm_len=norm_len)
    loss = agg_loss(loss_mat, mask, loss_agg_mode, **counts)
    # verl reports GSPO's ppo_kl from the unclamped token log-ratios, not the clamped sequence one.
    metrics = _pg_metrics(loss_mat, mask, loss_agg_mode, counts, pg_clipfrac=loss2 > loss1,
                          pg_clipfrac_lower=torch.zeros_like(mask), ppo_kl=-log_ratio)
    return loss, metrics


@register_policy_loss("gpg")
def gpg_policy_loss(
    logp: torch.Tensor,  # [B, T]
    old_logp: torch.Tensor,  # [B, T]
    advantages: torch.Tensor,  # [B, T]
    mask: torch.Tensor,  # [B, T]
    *,
    loss_agg_mode: str = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    global_tokens: Optional[float] = None,
    global_seqs: Optional[float] = None,
    norm_len: Optional[float] = None,
) -> LossOut:
    """GPG: plain policy gradient -logp * A, no ratio and no clip (the clip arguments are ignored)."""
    mask = mask.to(logp.dtype)
    loss_mat = -logp * advantages  # [B, T]
    counts = dict(global_tokens=global_tokens, global_seqs=global_seqs, norm_len=norm_len)
    loss = agg_loss(loss_mat, mask, loss_agg_mode, **counts)
    # verl's GPG reports no metrics at all; ours keeps the keys every policy loss logs
    # (nothing is clipped, and ppo_kl is the unclamped log-ratio, as GSPO's).
    zeros = torch.zeros_like(mask)
    metrics = _pg_metrics(loss_mat, mask, loss_agg_mode, counts, pg_clipfrac=zeros, pg_clipfrac_lower=zeros,
                          ppo_kl=old_logp - logp)
    return loss, metrics


def value_loss(
    values: torch.Tensor,  # [B, T] current critic predictions
    old_values: torch.Tensor,  # [B, T] predictions when the batch was collected
    returns: torch.Tensor,  # [B, T]
    mask: torch.Tensor,  # [B, T]
    *,
    cliprange_value: float = 0.5,
    loss_agg_mode: str = "token-mean",
    global_tokens: Optional[float] = None,
    global_seqs: Optional[float] = None,
    norm_len: Optional[float] = None,
) -> LossOut:
    """Clipped value loss ``0.5 * max((v - R)^2, (clip(v, v_old +- eps) - R)^2)``, aggregated like
    the policy loss.

    Taking the max makes the clip pessimistic: a prediction may move further
    than ``cliprange_value`` from the old one only when that does not lower the loss.
    """
    mask = mask.to(values.dtype)
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)  # [B, T]
    loss1 = (values - returns) ** 2
    loss2 = (clipped - returns) ** 2
    loss_mat = 0.5 * torch.maximum(loss1, loss2)  # [B, T]
    counts = dict(global_tokens=global_tokens, global_seqs=global_seqs, norm_len=norm_len)
    loss = agg_loss(loss_mat, mask, loss_agg_mode, **counts)
    with torch.no_grad():
        vf_loss = Share(agg_loss(loss_mat, mask, loss_agg_mode, **counts).item())
    # Past the clip and the clipped loss won: old + (v - old) can round off v, so not loss2 > loss1 alone.
    clipped_won = (loss2 > loss1) & ((values - old_values).abs() > cliprange_value)
    metrics = {"critic/vf_loss": vf_loss,
               "critic/vf_clipfrac": token_share(clipped_won, mask, global_tokens),
               "critic/vpred_mean": token_share(values, mask, global_tokens)}
    return loss, metrics
