"""Sequence parallelism (verl's Ulysses) for the FSDP2 engine's packed forward: the ranks of an SP group run
the same packed row, each a contiguous 1/sp slice of its tokens.

    local, targets = shard_packed(packed, group)       # packing.py: this rank's slice of the padded row
    model(**local.model_kwargs(), ...)                 # every projection and MLP on T/sp tokens
    full = gather_seq(local_outputs, group)            # [T_pad]: every rank's slice, in rank order
    outputs = full[packed.keep]                        # the padded [n, R] layout, as without SP

Attention is the one place that needs the whole sequence: ``heads_for_seq`` turns the sequence-sharded
q / k / v [1, H, T/sp, D] into head-sharded [1, H/sp, T, D] with one ``all_to_all_single`` (gloo has no
list-form ``all_to_all``), attention runs over the whole sequences with the full row's boundaries, and
``seq_for_heads`` turns its output back. Key / value heads that sp does not divide are repeated to the
query heads first (GQA with fewer KV heads than SP ranks).

Targets are shifted on the whole packed row before it is sliced (``packing.shard_packed``): the last token of
a slice is scored against the first token of the next slice, which another rank holds (verl #6068 shifted
after slicing and scored every slice's last token against the wrong one).

Gradients: every rank of the group computes the same loss from the same gathered outputs, so the gradient
of a rank's slice is that rank's part of the loss's gradient (``gather_seq``'s backward keeps it, no sum);
each rank's parameter gradients are its tokens' share, and FSDP, sharding over dp x sp, sums the shares.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spmdrl.config.model_folder import check_sp_heads
from spmdrl.errors import ConfigError

# The attribute the engine sets on every attention module of an SP model: the packed attention reads its
# group there, so activation checkpointing's recompute (outside any forward's context) finds it too.
SP_GROUP_ATTR = "spmdrl_sp_group"


class _AllToAll(torch.autograd.Function):
    """x [sp, ...]: chunk i goes to rank i, chunk j of the result came from rank j. Its own adjoint."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        # Contiguous first: empty_like keeps a view's strides, and the collective writes rows in order.
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class _GatherSeq(torch.autograd.Function):
    """x [T/sp, ...] -> [T, ...], the group's slices in rank order; the gradient of this rank's slice back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.rank, ctx.n = dist.get_rank(group), x.shape[0]
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n], None


def gather_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's slice of a per-token output [T/sp, ...] -> [T, ...] (autograd: ``_GatherSeq``)."""
    return _GatherSeq.apply(x, group)


def heads_for_seq(x: torch.Tensor, group: dist.ProcessGroup, heads: int) -> torch.Tensor:
    """[1, h, T/sp, D] sequence-sharded -> [1, heads/sp, T, D] head-sharded; ``heads`` > h repeats each head
    (key / value heads of a GQA model up to the query heads)."""
    sp = dist.get_world_size(group)
    x = x[0]
    if heads != x.shape[0]:
        x = x.repeat_interleave(heads // x.shape[0], dim=0)  # [heads, T/sp, D]
    _, local, dim = x.shape
    # [sp (from rank j), heads/sp, T/sp, D]
    x = _AllToAll.apply(x.reshape(sp, heads // sp, local, dim), group)
    return x.transpose(0, 1).reshape(1, heads // sp, sp * local, dim)


def seq_for_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[1, T, H/sp, D] head-sharded (attention's output layout) -> [1, T/sp, H, D] sequence-sharded."""
    sp = dist.get_world_size(group)
    _, total, heads, dim = x.shape
    x = _AllToAll.apply(x.reshape(sp, total // sp, heads, dim), group)  # [sp (from rank j), T/sp, H/sp, D]
    return x.transpose(0, 1).reshape(1, total // sp, sp * heads, dim)


def shard_attention(model: torch.nn.Module, group: dist.ProcessGroup, what: str) -> None:
    """Mark every attention module of ``model`` (those with transformers' ``num_key_value_groups``) so the
    packed attention runs Ulysses over ``group``; ConfigError when the group's size does not divide the
    heads (the run's config check said so before any model was loaded)."""
    config = getattr(model.config, "text_config", None) or model.config
    try:
        check_sp_heads(dist.get_world_size(group), config.to_dict(), what)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    for module in model.modules():
        if hasattr(module, "num_key_value_groups"):
            setattr(module, SP_GROUP_ATTR, group)


def kv_heads_for(sp: int, heads: int, kv_heads: int) -> int:
    """How many key / value heads go through the all-to-all: all of them when sp divides them, else
    repeated up to the query heads (which sp must divide: ``check_sp_heads``)."""
    return kv_heads if kv_heads % sp == 0 else heads
