"""Expert parallelism for an MoE model on the FSDP2 engine (``parallel.ep``), as torchtitan's
``ExpertParallel`` does it.

    apply_ep(model, dims.expert_mesh)           # before activation checkpointing and FSDP
    apply_fsdp(model, ..., expert_mesh=...)     # experts: FSDP over "efsdp", the rest over the whole dp mesh

The training ranks form a 2-D mesh (``efsdp`` x ``ep``, ``ParallelDims.expert_mesh``): an EP group of ``ep``
consecutive ranks splits every layer's experts, rank i of it owning experts [i E/ep, (i+1) E/ep) as DTensor
shards on ``ep``; FSDP then shards those over ``efsdp`` (the ranks that own the same experts) and every other
parameter over all the ranks, as without EP. Each rank still routes its own tokens; a layer's forward sends
each (token, expert) slot to the rank that owns the expert with one ``all_to_all_single`` (gloo has no list
form), runs its local experts on what it received, and sends the results back the same way; the backward
runs the two exchanges in reverse. A rank whose experts get no slot still joins both exchanges (with empty
splits) and gives its experts a zero gradient, so no collective waits on it.

Gradients: a rank's local experts see the slots of its whole EP group, so their gradient already sums the
group's tokens; FSDP reduce-scatters it over ``efsdp`` divided by the whole data-parallel size (not its own
mesh's), which makes it the same sum over every rank that the other parameters get.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from spmdrl.engines.fsdp2.parallelize import decoder_of


class _AllToAll(torch.autograd.Function):
    """Rows of x [sum(send), ...] in rank order, ``send[j]`` of them to rank j; returns [sum(recv), ...]. Its
    backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup
                ) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send,
                               group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), output_split_sizes=ctx.send,
                               input_split_sizes=ctx.recv, group=ctx.group)
        return out, None, None, None


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if isinstance(w, DTensor) else w


def _experts_forward(self: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """A Qwen3-MoE ``experts`` forward over the EP group: hidden [T, h], top_k_index / top_k_weights [T, k]
    (global expert ids, their weights) -> [T, h], each token's weighted sum of its experts' outputs."""
    group: dist.ProcessGroup = self.spmdrl_ep_group
    ep, E = dist.get_world_size(group), self.num_experts
    local = E // ep
    k = top_k_index.shape[1]
    slots = top_k_index.flatten()  # [T*k]
    order = torch.argsort(slots, stable=True)  # slots grouped by expert, so by owning rank
    counts = torch.bincount(slots, minlength=E).view(ep, local)  # [ep, local]: this rank's slots per expert
    theirs = torch.empty_like(counts)  # [ep, local]: each rank's slots for this rank's experts
    dist.all_to_all_single(theirs, counts.contiguous(), group=group)
    send, recv = counts.sum(1).tolist(), theirs.sum(1).tolist()
    x = _AllToAll.apply(hidden[order // k], send, recv, group)  # [R, h]: by source rank, then local expert
    expert = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(ep), theirs.flatten())  # [R]
    gate_up, down = _local(self.gate_up_proj), _local(self.down_proj)  # [local, 2I, h], [local, h, I]
    # The received rows and every local expert take part in the graph, used or not: a zero gradient, never a
    # missing one, and the first exchange's backward runs on every rank (a rank that received nothing would
    # otherwise skip it while the others wait for it in their all-to-all).
    y = x * 0.0 + 0.0 * (gate_up.sum() + down.sum())
    for e in torch.unique(expert).tolist():
        rows = (expert == e).nonzero().squeeze(-1)
        gate, up = F.linear(x[rows], gate_up[e]).chunk(2, -1)
        y = y.index_add(0, rows, F.linear(self.act_fn(gate) * up, down[e]))
    back = _AllToAll.apply(y, recv, send, group)  # [T*k] in ``order``
    weighted = back * top_k_weights.flatten()[order, None].to(back.dtype)
    return torch.zeros_like(hidden).index_add(0, order // k, weighted.to(hidden.dtype))


def apply_ep(model: nn.Module, expert_mesh: DeviceMesh) -> None:
    """Split every MoE layer's experts over ``expert_mesh["ep"]`` (DTensor shards of the fused tensors) and
    give the experts the all-to-all forward above."""
    ep_mesh = expert_mesh["ep"]
    for layer in decoder_of(model).layers:
        experts = layer.mlp.experts
        if experts.num_experts % ep_mesh.size():
            raise ValueError(f"parallel.ep is {ep_mesh.size()}, which does not divide the model's "
                             f"{experts.num_experts} experts")
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(experts, name)
            setattr(experts, name, nn.Parameter(distribute_tensor(p.data, ep_mesh, [Shard(0)]),
                                                requires_grad=p.requires_grad))
        experts.spmdrl_ep_group = ep_mesh.get_group()
        experts.forward = types.MethodType(_experts_forward, experts)
