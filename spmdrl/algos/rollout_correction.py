"""Rollout correction, as verl's ``algorithm.rollout_correction``: importance weights and rejection masks
for the gap between the distribution the rollout engine sampled from and the one the trainer computes,
and the diagnostics of that gap.

The rollout engine samples with its own kernels (often bf16, fused, another reduction order); the loss
is computed from the actor's forward of the same weights. Per token, ``log_ratio = old_logp -
rollout_logp`` = log(pi_train / pi_rollout). Without correction the PPO ratio is taken against
pi_train, so the update ignores that the tokens came from pi_rollout.

- ``rollout_is`` (token | sequence): truncated importance sampling (TIS). Each token's policy-gradient
  term is multiplied by ``min(rho, rollout_is_threshold)``, rho the token's ratio or the product over
  the response. Weights never carry gradient.
- ``rollout_rs`` (token | sequence | geometric): rejection. Tokens, or whole responses by the product
  or the geometric mean of their ratios, whose ratio leaves ``[lower, upper]`` leave the loss.
- ``rollout_token_veto_threshold``: a response holding any token with rho below it leaves the loss.

Every statistic is batch-wide: local sums are all-reduced over ``group``, so one rank and k ranks
log the same numbers; ``group=None`` keeps them to this rank's rows, with no collective (a
micro-batch's diagnostics inside the loss, where ranks may run different numbers of micro-batches).
Ratios are exponentiated inside exp(+-20), as verl does.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

SAFETY_BOUND = 20.0
IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")
PREFIX = "rollout_corr/"


class _Stats:
    """Batch-wide sums, maxima and minima, reduced in three collectives at ``reduce()``."""

    def __init__(self, group: Optional[dist.ProcessGroup]) -> None:
        self.group, self.sums, self.maxs, self.mins = group, {}, {}, {}

    def add(self, name: str, value: torch.Tensor) -> None:
        self.sums[name] = value.double().sum()

    def extremes(self, name: str, values: torch.Tensor) -> None:
        self.maxs[name] = values.double().max() if values.numel() else torch.tensor(-math.inf).double()
        self.mins[name] = values.double().min() if values.numel() else torch.tensor(math.inf).double()

    def reduce(self) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        out = []
        for values, op in ((self.sums, dist.ReduceOp.SUM), (self.maxs, dist.ReduceOp.MAX),
                           (self.mins, dist.ReduceOp.MIN)):
            keys = sorted(values)
            t = torch.stack([values[k] for k in keys]) if keys else torch.zeros(0, dtype=torch.float64)
            if keys and self.group is not None and dist.get_world_size(self.group) > 1:
                dist.all_reduce(t, op=op, group=self.group)
            out.append(dict(zip(keys, t.tolist())))
        return out[0], out[1], out[2]


def _seq_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum(-1)  # [N]


def _safe_exp(log: torch.Tensor) -> torch.Tensor:
    return torch.exp(log.clamp(-SAFETY_BOUND, SAFETY_BOUND))


def offpolicy_stats(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                    stats: _Stats) -> None:
    """Local sums of the gap's diagnostics (verl's compute_offpolicy_metrics), finished in ``_finish``."""
    m = mask.to(torch.float64)  # [N, R]
    seqs = (m.sum(-1) > 0).to(torch.float64)  # [N]
    log_ratio = (old_logp - rollout_logp).double()  # [N, R]
    lengths = m.sum(-1).clamp(min=1)  # [N]
    mean_train = _seq_sum(old_logp.double(), m) / lengths  # [N]
    mean_rollout = _seq_sum(rollout_logp.double(), m) / lengths  # [N]
    log_ppl_diff = mean_rollout - mean_train  # [N] log(ppl_train / ppl_rollout)
    stats.add("tokens", m)
    stats.add("seqs", seqs)
    stats.add("kl", -log_ratio * m)
    stats.add("k3_kl", (torch.exp(log_ratio.clamp(max=SAFETY_BOUND)) - log_ratio - 1) * m)
    stats.add("training_ppl", torch.exp(-mean_train) * seqs)
    stats.add("rollout_ppl", torch.exp(-mean_rollout) * seqs)
    stats.add("training_log_ppl", -mean_train * seqs)
    stats.add("rollout_log_ppl", -mean_rollout * seqs)
    stats.add("log_ppl_diff", log_ppl_diff * seqs)
    stats.add("log_ppl_abs_diff", log_ppl_diff.abs() * seqs)
    stats.add("ppl_ratio", torch.exp(log_ppl_diff) * seqs)
    stats.add("chi2_token", _safe_exp(log_ratio).square() * m)
    stats.add("chi2_seq", torch.exp(2 * _seq_sum(log_ratio, m).clamp(-SAFETY_BOUND, SAFETY_BOUND)) * seqs)
    stats.extremes("log_ppl_diff", log_ppl_diff[seqs.bool()])


def _level_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Per-token log-ratio [N, R] of the aggregation ``level`` (a response's value on all its tokens)."""
    if level == "token":
        return log_ratio
    total = _seq_sum(log_ratio, mask)  # [N]
    if level == "geometric":
        total = total / mask.sum(-1).clamp(min=1)
    return total[:, None].expand_as(log_ratio)


def _units(values: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """The values of the level's units: one per valid token, or one per response."""
    if level == "token":
        return values[mask.bool()]
    return values[:, 0][mask.sum(-1) > 0]


def rollout_correction(
    old_logp: torch.Tensor,  # [N, R] the actor's log-probs of the sampled tokens
    rollout_logp: torch.Tensor,  # [N, R] the rollout engine's log-probs of the same tokens
    mask: torch.Tensor,  # [N, R] valid response tokens
    *,
    rollout_is: Optional[str] = None,
    rollout_is_threshold: float = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: Optional[str] = None,
    rollout_rs_threshold: Optional[float] = None,
    rollout_rs_threshold_lower: Optional[float] = None,
    rollout_token_veto_threshold: Optional[float] = None,
    group: Optional[dist.ProcessGroup] = None,
) -> tuple[Optional[torch.Tensor], torch.Tensor, dict[str, float]]:
    """(IS weights [N, R] or None, the mask with rejected tokens removed [N, R], ``rollout_corr/*``
    metrics). With every option off it only measures the gap."""
    mask = mask.to(torch.float32)
    log_ratio = (old_logp - rollout_logp).float()  # [N, R]
    stats = _Stats(group)
    offpolicy_stats(old_logp, rollout_logp, mask, stats)
    weights, kept = None, mask.clone()
    if rollout_is is not None:
        raw = _safe_exp(_level_log_ratio(log_ratio, mask, rollout_is)) * mask  # [N, R]
        _is_stats(raw, mask, rollout_is, rollout_is_threshold, stats)
        weights = raw.clamp(max=rollout_is_threshold)
    if rollout_rs is not None:
        upper = rollout_rs_threshold
        lower = rollout_rs_threshold_lower if rollout_rs_threshold_lower is not None else 1.0 / upper
        rho = _safe_exp(_level_log_ratio(log_ratio, mask, rollout_rs))  # [N, R]
        inside = ((rho >= lower) & (rho <= upper)).float()
        kept = kept * inside
        stats.add("rollout_rs_masked", (1 - inside) * mask)
        stats.add("rollout_rs_seq_masked", ((1 - inside) * mask).sum(-1) > 0)
    if rollout_token_veto_threshold is not None:
        vetoed = ((log_ratio < math.log(rollout_token_veto_threshold)) & mask.bool())  # [N, R]
        veto_rows = vetoed.any(-1)  # [N]
        kept = kept * (~veto_rows).float()[:, None]
        stats.add("rollout_is_veto", veto_rows)
        stats.add("rollout_is_catastrophic_token", vetoed)
    sums, maxs, mins = stats.reduce()
    if weights is not None and rollout_is_batch_normalize:
        # The mean truncated weight of the batch's units (tokens, or responses at the sequence level).
        norm = sums["is_clamped_unit"] / max(sums["is_units"], 1.0)
        weights = weights / norm if norm > 1e-8 else weights
        sums["batch_norm_factor"] = norm
    return weights, kept, _finish(sums, maxs, mins, rollout_is, rollout_rs, rollout_token_veto_threshold)


def _is_stats(raw: torch.Tensor, mask: torch.Tensor, level: str, threshold: float, stats: _Stats) -> None:
    """IS weight statistics before truncation: mean, extremes, share above the threshold (capped),
    spread and effective sample size (of weights clamped to [1/threshold, threshold], as verl)."""
    clamped = raw.clamp(1.0 / threshold, threshold) * mask
    units = _units(raw, mask, level)
    stats.add("is_w", raw * mask)
    stats.add("is_ess_w", clamped)
    stats.add("is_ess_w2", clamped.square())
    stats.add("is_units", torch.ones_like(units))
    stats.add("is_clamped_unit", units.clamp(max=threshold))
    stats.add("is_high", units > threshold)
    stats.add("is_low", units < 1.0 / threshold)
    stats.extremes("rollout_is", units)


def _finish(sums: dict[str, float], maxs: dict[str, float], mins: dict[str, float], rollout_is: Optional[str],
            rollout_rs: Optional[str], veto: Optional[float]) -> dict[str, float]:
    """Batch-wide metrics from the reduced sums, under verl's names."""
    tokens, seqs = max(sums["tokens"], 1.0), max(sums["seqs"], 1.0)
    out = {k: sums[k] / tokens for k in ("kl", "k3_kl")}
    per_seq = ("training_ppl", "rollout_ppl", "training_log_ppl", "rollout_log_ppl", "log_ppl_diff",
               "log_ppl_abs_diff", "ppl_ratio")
    out.update({k: sums[k] / seqs for k in per_seq})
    out["chi2_token"] = sums["chi2_token"] / tokens - 1.0
    out["chi2_seq"] = sums["chi2_seq"] / seqs - 1.0
    out["log_ppl_diff_max"], out["log_ppl_diff_min"] = maxs["log_ppl_diff"], mins["log_ppl_diff"]
    if rollout_is is not None:
        units = max(sums["is_units"], 1.0)
        mean, mean2 = sums["is_ess_w"] / tokens, sums["is_ess_w2"] / tokens
        out.update({
            "rollout_is_mean": sums["is_w"] / tokens,
            "rollout_is_max": maxs["rollout_is"], "rollout_is_min": mins["rollout_is"],
            "rollout_is_ratio_fraction_high": sums["is_high"] / units,  # the share of capped weights
            "rollout_is_ratio_fraction_low": sums["is_low"] / units,
            "rollout_is_std": math.sqrt(max(mean2 - mean * mean, 0.0)),
            "rollout_is_eff_sample_size": mean * mean / mean2 if mean2 > 0 else 1.0,
        })
        if "batch_norm_factor" in sums:
            out["rollout_is_batch_norm_factor"] = sums["batch_norm_factor"]
    if rollout_rs is not None:
        out["rollout_rs_masked_fraction"] = sums["rollout_rs_masked"] / tokens
        out["rollout_rs_seq_masked_fraction"] = sums["rollout_rs_seq_masked"] / seqs
    if veto is not None:
        out["rollout_is_veto_fraction"] = sums["rollout_is_veto"] / seqs
        out["rollout_is_catastrophic_token_fraction"] = sums["rollout_is_catastrophic_token"] / tokens
    return {PREFIX + k: float(v) for k, v in out.items()}
