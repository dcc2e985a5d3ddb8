"""Masked reductions that can span every data-parallel rank.

Each rank holds a slice of the batch. A batch-wide statistic (the mean and
variance used to whiten advantages, the batch-mean KL) must be the statistic of
the whole batch, so with ``group`` set the per-rank sums and counts are
all-reduced before dividing: k ranks then give what 1 rank gives on the
concatenated batch, up to float rounding. With ``group=None`` (or when
torch.distributed is not initialised) everything is rank-local.

Variance is computed in two passes (global mean first, then the global sum of
squared deviations) rather than from a raw sum of squares, because
``E[x^2] - E[x]^2`` cancels catastrophically when the mean is large.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

WHITEN_EPS = 1e-8


class Share(float):
    """A loss metric that is one micro-batch's share of a global quantity: a sum over its rows divided by
    the mini-batch's global count (``LossScale``), as the loss itself is. The training engine sums shares
    over micro-batches and data-parallel ranks (then averages over mini-batches), so the logged value is
    the mini-batch's own, whatever the micro-batching, packing or world size; a plain float metric is
    averaged over micro-batches instead."""


def _distributed(group: Optional[dist.ProcessGroup]) -> bool:
    return group is not None and dist.is_available() and dist.is_initialized()


def all_reduce_sum(local: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Sum of ``local`` over the group, differentiable through this rank's own share.

    The collective runs on a detached copy (c10d ops have no autograd); adding
    the other ranks' contribution as a constant keeps the gradient of this
    rank's data intact, which is the gradient each rank needs under DP.
    """
    if not _distributed(group):
        return local
    total = local.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return local + (total - local.detach())


def masked_sum(
    x: torch.Tensor,
    mask: torch.Tensor,
    dim: Optional[int] = None,
    *,
    group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """Sum of ``x`` where ``mask`` is set: over ``dim`` (rank-local), or over everything and ``group``."""
    masked = x * mask.to(x.dtype)
    if dim is not None:
        if group is not None:
            raise ValueError("masked_sum: a per-row reduction (dim set) is rank-local; pass group=None")
        return masked.sum(dim)
    return all_reduce_sum(masked.sum(), group)


def masked_mean(
    x: torch.Tensor,
    mask: torch.Tensor,
    dim: Optional[int] = None,
    *,
    group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is set; 0 where nothing is set (not NaN)."""
    m = mask.to(x.dtype)
    if dim is not None:
        if group is not None:
            raise ValueError("masked_mean: a per-row reduction (dim set) is rank-local; pass group=None")
        return (x * m).sum(dim) / m.sum(dim).clamp(min=1)
    # One collective for both numbers: sum and count travel together.
    stats = all_reduce_sum(torch.stack([(x * m).sum(), m.sum()]), group)  # [2]
    return stats[0] / stats[1].clamp(min=1)


def masked_var(
    x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True, *, group: Optional[dist.ProcessGroup] = None
) -> torch.Tensor:
    """Variance of the masked entries of ``x`` over the whole (global) batch; Bessel-corrected by default."""
    m = mask.to(x.dtype)
    stats = all_reduce_sum(torch.stack([(x * m).sum(), m.sum()]), group)  # [2]: sum, count
    count = stats[1].detach()
    if count.item() == 0:
        raise ValueError("masked_var: the mask selects no element, so the variance is undefined")
    if unbiased and count.item() == 1:
        raise ValueError("masked_var: the mask selects one element, so the unbiased variance is undefined")
    mean = stats[0] / count
    sq_dev = all_reduce_sum(((x - mean) ** 2 * m).sum(), group)
    return sq_dev / (count - 1) if unbiased else sq_dev / count


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    *,
    group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """``(x - mean) * rsqrt(var + 1e-8)`` with the masked mean and unbiased variance of the (global) batch.

    ``shift_mean=False`` adds the mean back, so only the scale is normalised.
    Values under the mask's zeros are transformed too; callers multiply by the
    mask when padding must stay zero.
    """
    mean = masked_mean(x, mask, group=group)
    var = masked_var(x, mask, unbiased=True, group=group)
    whitened = (x - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return whitened
