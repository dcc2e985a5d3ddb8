"""Mixture-of-Experts routing in the FSDP2 engine: router logits in fp32, routing replay, and what the
routing did (expert load, agreement with the rollout's routing).

    routing = install_routing(model)          # None for a dense model; before checkpointing and FSDP
    routing.begin(rollout=routes, valid=mask, force=True, observe=True, record=False)  # routes [T, L, k]
    out = model(**inputs)                     # every router reads the state set by begin
    recorded = routing.recorded()             # [T, L, k]: the experts each token went to, per MoE layer

Each Qwen3-MoE router (``mlp.gate``, transformers' ``Qwen3MoeTopKRouter``) gets this file's forward. It
computes its logits in fp32 from fp32 copies of the hidden state and of the (bf16 under mixed precision)
weight, as NeMo-RL recommends and as the native engine does, so both pick experts from the same numbers.
The softmax and the top-k follow transformers (softmax in fp32, ``torch.topk``, the top-k renormalised
when ``norm_topk_prob``).

Routing replay (``actor.router_replay``): with ``force``, a token takes the experts of ``rollout`` instead
of its own top-k, and their weights are the router's current probabilities at those experts (renormalised
as above), so the router still gets a gradient. R3 replays what the rollout engine recorded; R2 what the
actor's old-log-prob pass recorded. A token whose route is ``unrouted(E)`` (no record: a tool's output in a
multi-turn response, a prefix the rollout restored from its cache) keeps the router's own choice.

The state stays set after the forward: activation checkpointing recomputes each layer in the backward,
outside any context, and must route its tokens as the forward did. ``observe`` counts the forward's
routing (load, agreement) and is switched off by ``end`` before the backward, so a recompute counts
nothing twice.
"""

from __future__ import annotations

import types
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from spmdrl.batch import Batch, route_dtype, unrouted
from spmdrl.engines.fsdp2.parallelize import decoder_of

MOE_MODEL_TYPES = ("qwen3_moe",)


class Routing:
    """What every router of one model reads and writes during a forward (see the module docstring)."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.norm_topk_prob = norm_topk_prob
        self.rollout: Optional[torch.Tensor] = None  # [T, L, k] long
        self.valid: Optional[torch.Tensor] = None  # [T] bool: real tokens (not padding)
        self.force = False
        self.observing = False
        self.recording = False
        self.balancing = False  # add up the load-balancing loss (``aux_loss``) in this forward
        self.scoring = False
        self.aux_loss: Optional[torch.Tensor] = None
        self._record: list[Optional[torch.Tensor]] = [None] * num_layers
        self.reset_stats()

    def reset_stats(self, device: torch.device | str = "cpu") -> None:
        """Zero the counts, kept on the routers' device (no host sync per layer; ``metrics`` reduces them
        there, as the process group's backend wants)."""
        self.load = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64, device=device)
        self.agree = torch.zeros(2, dtype=torch.float64, device=device)  # slots agreed on, slots compared
        self.agree_scored = torch.zeros(2, dtype=torch.float64, device=device)  # no-grad passes (old logp)

    def begin(self, rollout: Optional[torch.Tensor], valid: Optional[torch.Tensor], force: bool,
              observe: bool, record: bool, balance: bool = False, score: bool = False) -> None:
        """Set what the next forward's routers read: ``rollout`` [T, L, k] in the forward's token order, and
        whether they count their routing (``observe``: an update's), compare it with ``rollout`` alone
        (``score``: a no-grad pass's), keep it for ``recorded`` (``record``) and add up the load-balancing
        loss (``balance``)."""
        self.rollout = None if rollout is None else rollout.long()
        self.valid = valid
        self.force = force and rollout is not None
        self.observing, self.recording, self.balancing, self.scoring = observe, record, balance, score
        self._record = [None] * self.num_layers
        self.aux_loss = None

    def begin_micro(self, micro: Batch, packed: bool, sp_group: Optional[dist.ProcessGroup], *, role: str,
                    replay: str, training: bool, observe: bool, balance: bool) -> bool:
        """``begin`` for one micro-batch of the FSDP2 engine, in its forward's token order (padded, packed, or
        an SP slice of packed): the actor and the reference replay its ``routed_experts`` under R3, the
        actor's update under R2 too; the actor's no-grad pass compares them with its own routing, and under
        R2 records it (returns whether it records: ``recorded_rows`` then)."""
        force = role in ("actor", "ref") and (replay == "R3" or (training and replay == "R2"))
        record = role == "actor" and not training and replay == "R2"
        valid = micro["attention_mask"].bool()  # [n, P+R]
        routes = micro.get("routed_experts")  # [n, P+R, L, k]
        if routes is not None:
            routes = token_order(routes, valid, packed, sp_group, unrouted(self.num_experts))
        mask = token_order(valid, valid, packed, sp_group, False)
        self.begin(routes, mask, force, observe, record, balance, score=role == "actor" and not training)
        return record

    def recorded_rows(self, micro: Batch, packed: bool, sp_group: Optional[dist.ProcessGroup]
                      ) -> torch.Tensor:
        """What ``begin_micro``'s forward recorded, in the micro-batch's rows: [n, P+R, L, k]."""
        valid = micro["attention_mask"].bool()
        return row_order(self.recorded(), valid, packed, sp_group, unrouted(self.num_experts))

    def end(self) -> None:
        self.observing = self.recording = self.balancing = self.scoring = False

    def recorded(self) -> torch.Tensor:
        """[T, L, k] the experts of every token of the last forward (``route_dtype``)."""
        return torch.stack(self._record, 1).to(route_dtype(self.num_experts))

    def choose(self, layer: int, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, experts [T, k]) of one layer's tokens from its router's probs [T, E]."""
        top_p, top_i = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        used = top_i
        if self.load.device != probs.device:  # the first forward on this device
            self.reset_stats(probs.device)
        if self.rollout is not None:
            theirs = self.rollout[:, layer]  # [T, k]
            known = theirs[:, 0] != unrouted(self.num_experts)  # [T]
            if self.observing or self.scoring:
                mask = known if self.valid is None else known & self.valid
                same = (top_i[:, :, None] == theirs[:, None, :]).any(1)  # [T, k] their expert is in ours
                counts = torch.stack([same[mask].sum(), mask.sum() * self.top_k]).double()
                if self.observing:
                    self.agree += counts
                else:
                    self.agree_scored += counts
            if self.force:
                used = torch.where(known[:, None], theirs, top_i)
                top_p = probs.gather(-1, used)
        if self.norm_topk_prob:
            top_p = top_p / top_p.sum(-1, keepdim=True)
        if self.balancing:
            self._balance(probs, used)
        if self.recording:
            self._record[layer] = used.detach()
        if self.observing:
            counted = used if self.valid is None else used[self.valid]
            self.load[layer] += torch.bincount(counted.flatten(), minlength=self.num_experts).double()
        return top_p, used

    def _balance(self, probs: torch.Tensor, used: torch.Tensor) -> None:
        """Add one layer's share of the load-balancing loss (Switch Transformer's, as transformers computes
        it): E x sum over experts of (the fraction of token slots sent to it) x (its mean probability), over
        this forward's real tokens, averaged over layers; 1 when both are uniform."""
        if self.valid is not None:
            probs, used = probs[self.valid], used[self.valid]
        if len(probs) == 0:  # an SP slice of padding alone
            return
        E = self.num_experts
        share = torch.bincount(used.flatten(), minlength=E).to(probs.dtype) / max(used.numel(), 1)  # [E]
        loss = E * (share.detach() * probs.mean(0)).sum() / self.num_layers
        self.aux_loss = loss if self.aux_loss is None else self.aux_loss + loss

    def weighted_aux_loss(self, share: float, tokens: int) -> torch.Tensor:
        """The forward's load-balancing loss weighted as a token-mean loss: by ``share``, its micro-batch's
        share of the mini-batch's response tokens, and by its share of the micro-batch's ``tokens`` (under SP
        each rank balances its own slice, and their gradients add up)."""
        local = tokens if self.valid is None else int(self.valid.sum())
        return self.aux_loss * share * local / tokens

    def metrics(self, groups: list[dist.ProcessGroup], prefix: str, device: torch.device) -> dict[str, float]:
        """Load and agreement of the observed forwards since ``reset_stats``, summed over ``groups`` (the
        ranks that held other tokens), so that 1 and k ranks report the same numbers: ``router_agreement``,
        the share of the recorded experts (R3: the rollout's, R2: the old pass's) that the router still picks
        in the update, and ``old_logp_router_agreement``, the share of the batch's recorded experts (the
        rollout's) that it picks in the no-grad passes before the update."""
        # On the device the groups' backend reduces on (gloo: CPU, NCCL: the GPU).
        stats = torch.cat([self.load.flatten(), self.agree_scored, self.agree]).to(device)
        for group in groups:
            dist.all_reduce(stats, group=group)
        stats = stats.cpu()
        load = stats[:-4].view(self.num_layers, self.num_experts)  # [L, E]
        out: dict[str, float] = {}
        if float(load.sum()) > 0:
            ratio = load.max(1).values / load.mean(1).clamp(min=1e-12)  # [L] 1 = perfectly balanced
            out[f"{prefix}/expert_load_max_over_mean"] = float(ratio.mean())
            out[f"{prefix}/expert_load_max_over_mean/max"] = float(ratio.max())
            out[f"{prefix}/experts_unused"] = float((load == 0).sum()) / self.num_layers
        if float(stats[-1]) > 0:
            out[f"{prefix}/router_agreement"] = float(stats[-2] / stats[-1])
        if float(stats[-3]) > 0:  # before the update moved the router: what the engines differ by alone
            out[f"{prefix}/old_logp_router_agreement"] = float(stats[-4] / stats[-3])
        self.reset_stats(self.load.device)
        return out


def token_order(x: torch.Tensor, valid: torch.Tensor, packed: bool, sp_group: Optional[dist.ProcessGroup],
                fill: int | bool) -> torch.Tensor:
    """Per-position values x [n, S, ...] in the order a forward's routers see its tokens: every position
    (padded), the valid ones one after another (packed), or this rank's slice of those, padded to a multiple
    of the SP size with ``fill`` (``packing.shard_packed``)."""
    if not packed:
        return x.flatten(0, 1)  # [n*S, ...]
    t = x[valid]  # [T, ...]
    if sp_group is None:
        return t
    sp, rank = dist.get_world_size(sp_group), dist.get_rank(sp_group)
    t = torch.cat([t, t.new_full((-len(t) % sp, *t.shape[1:]), fill)])
    n = len(t) // sp
    return t[rank * n:(rank + 1) * n]


def row_order(t: torch.Tensor, valid: torch.Tensor, packed: bool, sp_group: Optional[dist.ProcessGroup],
              fill: int) -> torch.Tensor:
    """``token_order``'s inverse: [T, ...] back to [n, S, ...], ``fill`` where no token is (padding)."""
    if packed and sp_group is not None:  # every rank's slice, in rank order, then the SP padding dropped
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(sp_group))]
        dist.all_gather(parts, t.contiguous(), group=sp_group)
        t = torch.cat(parts)[:int(valid.sum())]
    out = t.new_full((*valid.shape, *t.shape[1:]), fill)  # [n, S, ...]
    if packed:
        out[valid] = t
    else:
        out[valid] = t.view(*valid.shape, *t.shape[1:])[valid]
    return out


def _route(self: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Qwen3-MoE router's forward: (logits [T, E] fp32, weights [T, k] in the hidden dtype, experts)."""
    routing: Routing = self.spmdrl_routing
    h = hidden.reshape(-1, hidden.shape[-1])  # [T, h]
    logits = F.linear(h.float(), self.weight.float())  # [T, E]
    probs = torch.softmax(logits, dim=-1)
    weights, experts = routing.choose(self.spmdrl_layer, probs)
    return logits, weights.to(hidden.dtype), experts


def install_routing(model: nn.Module) -> Optional[Routing]:
    """Give every router of an MoE model (``MOE_MODEL_TYPES``) this file's forward; None for a dense one.
    Before activation checkpointing, compile and FSDP wrap the layers."""
    cfg = model.config
    if getattr(cfg, "model_type", None) not in MOE_MODEL_TYPES:
        return None
    routers = [layer.mlp.gate for layer in decoder_of(model).layers]
    routing = Routing(len(routers), cfg.num_experts, cfg.num_experts_per_tok, bool(cfg.norm_topk_prob))
    for i, router in enumerate(routers):
        router.spmdrl_routing, router.spmdrl_layer = routing, i
        router.forward = types.MethodType(_route, router)
    return routing
