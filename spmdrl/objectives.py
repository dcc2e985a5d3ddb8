"""The actor's, critic's and SFT's loss callables, built once from the config.

The pure functions live in ``spmdrl.algos``; this file binds the config's
scalars to them and returns ``LossFn`` closures that the training engine calls
per micro-batch with the forward outputs and the mini-batch's global counts
(``LossScale``), so token-mean losses divide by the global token count.
"""

from __future__ import annotations

import torch

from spmdrl.algos.losses import agg_loss, value_loss
from spmdrl.algos.registry import get_kl, get_policy_loss
from spmdrl.algos.rollout_correction import rollout_correction
from spmdrl.algos.utils import Share
from spmdrl.batch import Batch
from spmdrl.config import Config
from spmdrl.engines.base import LossFn, LossScale
from spmdrl.experience import sampling_params


def actor_loss_fn(cfg: Config) -> LossFn:
    """PPO-family policy loss + optional KL-to-reference loss - entropy bonus."""
    a = cfg.actor
    policy_loss = get_policy_loss(a.policy_loss)
    kl_fn = get_kl(a.kl_loss_type) if a.use_kl_loss else None
    norm_len = a.loss_scale_factor or cfg.data.max_response_length
    # The rollout gap is measured only against the actor's own (untruncated) distribution.
    gap_comparable = sampling_params(cfg).full_distribution

    def loss_fn(outputs: dict, mb: Batch, scale: LossScale):
        logp = outputs["logp"]  # [b, R]
        mask = mb["response_mask"]  # [b, R]
        # Without old_logp (one on-policy pass) the policy that sampled is the current one, detached.
        old_logp = mb["old_logp"] if "old_logp" in mb else logp.detach()
        advantages = mb["advantages"]  # [b, R]
        if "rollout_is_weights" in mb:
            # Every policy loss is positively homogeneous in A (the clips act on the ratio), so weighting
            # A weights each token's clipped term, as verl multiplies pg_losses (rollout correction).
            advantages = advantages * mb["rollout_is_weights"]
        counts = dict(global_tokens=scale.global_tokens, global_seqs=scale.global_seqs, norm_len=norm_len)
        loss, metrics = policy_loss(
            logp, old_logp, advantages, mask, loss_agg_mode=a.loss_agg_mode,
            clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high, clip_ratio_c=a.clip_ratio_c,
            **counts,
        )
        # Entropy and KL as the loss aggregates them, shares of the mini-batch's value (algos.utils.Share).
        if "entropy" in outputs:
            entropy = agg_loss(outputs["entropy"], mask, a.loss_agg_mode, **counts)
            metrics["actor/entropy"] = Share(entropy.item())
            if a.entropy_coeff:
                loss = loss - a.entropy_coeff * entropy
        if kl_fn is not None:
            kl = agg_loss(kl_fn(logp, mb["ref_logp"]), mask, a.loss_agg_mode, **counts)  # [b, R] -> share
            loss = loss + a.kl_loss_coef * kl
            metrics["actor/kl_loss"] = Share(kl.item())
            metrics["actor/kl_coef"] = a.kl_loss_coef
        if "old_logp" not in mb and "rollout_logp" in mb and gap_comparable:
            metrics.update(rollout_gap_metrics(logp.detach(), mb["rollout_logp"], mask))
        return loss, metrics

    return loss_fn


def rollout_gap_metrics(logp: torch.Tensor, rollout_logp: torch.Tensor,
                        mask: torch.Tensor) -> dict[str, float]:
    """The rollout-vs-training diagnostics of one micro-batch, from the training forward itself (the loop
    computes them batch-wide when it has old_logp). The engine averages them over micro-batches and
    ranks, so batch-wide extremes are left out."""
    # This rank's rows only (group None: no collective): under token budgets ranks run different numbers
    # of micro-batches, and a collective here hung the update (the combination matrix's ppo case).
    _, _, metrics = rollout_correction(logp, rollout_logp, mask, group=None)
    return {k: v for k, v in metrics.items() if not k.endswith(("_max", "_min"))}


def critic_loss_fn(cfg: Config) -> LossFn:
    """Clipped value loss around the values the critic predicted before the update."""
    c = cfg.critic

    def loss_fn(outputs: dict, mb: Batch, scale: LossScale):
        return value_loss(
            outputs["values"], mb["values"], mb["returns"], mb["response_mask"],
            cliprange_value=c.cliprange_value, loss_agg_mode=cfg.actor.loss_agg_mode,
            global_tokens=scale.global_tokens, global_seqs=scale.global_seqs,
            norm_len=cfg.actor.loss_scale_factor or cfg.data.max_response_length,
        )

    return loss_fn


def sft_loss_fn() -> LossFn:
    """Token-mean negative log-likelihood of the target tokens (``response_mask``: SFT's response or assistant
    tokens), over the global token count of the batch, so micro-batching and DP do not change it.

    Its metric ``sft/loss`` is that loss as a share (``algos.utils.Share``): the engine's sum over
    micro-batches and ranks is the exact token-mean loss of the whole batch.
    """

    def loss_fn(outputs: dict, mb: Batch, scale: LossScale):
        mask = mb["response_mask"]  # [b, L-1]
        nll = -outputs["logp"]  # [b, L-1]
        loss = agg_loss(nll, mask, "token-mean", global_tokens=scale.global_tokens)
        return loss, {"sft/loss": Share(loss.item())}

    return loss_fn
