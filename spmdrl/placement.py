"""Which prompt groups each rank trains on: its share of every global mini-batch, at any world size.

The update cuts each rank's rows into mini-batches (``ppo_mini_batch_size`` prompts x n over the ranks),
and global mini-batch j is the union of the ranks' j-th mini-batches. For that union to hold the same
prompts on 1 rank or on k, rank r keeps, of every *slot* of the step's prompts in their global order, its
r-th contiguous block:

    global order    [ slot 0           | slot 1           | ... ]      slot: prompts inside one mini-batch
    rank r of W       block r of slot 0, block r of slot 1, ...         of every trained model (actor, critic)

The loader hands prompts out that way (``slot_positions``), so a plain colocated step moves nothing.
Rows placed otherwise are moved by ``place_groups``: DAPO's rounds keep different groups on each rank
(the first K kept groups in global prompt order are trained, whatever rank drew them), and rollout TP
ranks keep contiguous shares of their group's responses. Every row carries ``order``, its prompt's
position in the run's prompt stream, so the global order is known on every rank.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.distributed as dist

from spmdrl.batch import Batch
from spmdrl.engines.balance import trim_padding
from spmdrl.engines.base import gather_rows
from spmdrl.parallel import gather_bytes

if TYPE_CHECKING:
    from spmdrl.config import Config


def slot_prompts(cfg: "Config", critic: Optional[bool] = None) -> int:
    """Prompts per slot: the largest run of the global order inside one mini-batch of every trained model
    (the actor's ``ppo_mini_batch_size``; with a critic, its own too), and inside one step's batch."""
    if critic is None:
        from spmdrl.algos.registry import ADVANTAGES

        critic = bool(ADVANTAGES.meta(cfg.algorithm.adv_estimator).get("needs_values"))
    sizes = [cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size]
    if critic:
        sizes.append(cfg.critic.ppo_mini_batch_size)
    return math.gcd(*sizes)


def slot_positions(n: int, slot: int, rank: int, world: int) -> list[int]:
    """Positions (of ``n`` in global order) that rank ``rank`` of ``world`` holds: its contiguous block of
    each slot of ``slot`` positions. A slot the world does not divide cannot be shared evenly: then the whole
    ``n`` is one slot (each rank a contiguous block, sizes differing by at most one)."""
    if slot < 1 or slot % world or n % world:
        slot = n
    out: list[int] = []
    for start in range(0, n, slot):
        size = min(slot, n - start)
        out.extend(range(start + rank * size // world, start + (rank + 1) * size // world))
    return out


def _groups_in_order(keys: Sequence[Sequence[int]], want: int, world: int) -> list[tuple[int, int]]:
    """(rank, local group) of the first ``want`` groups in global order, rounded down to a multiple of
    ``world`` so that every rank trains as many; ``keys[r][g]`` is the order of rank r's g-th group."""
    every = sorted((key, r, g) for r, per_rank in enumerate(keys) for g, key in enumerate(per_rank))
    take = min(want, len(every)) // world * world
    return [(r, g) for _, r, g in every[:take]]


def own_groups(batch: Batch, n: int, want: int, slot: int, rank: int, world: int) -> Batch:
    """(a rank holding every row, as split placement's training ranks do) Rank ``rank``'s share of the
    first ``want`` groups of ``batch`` in global order: the same rows ``place_groups`` would leave it."""
    # A batch held by a checkpoint of before the order field keeps the order it came in.
    order = batch["order"] if "order" in batch else torch.arange(len(batch))
    keys = order.view(-1, n)[:, 0].tolist()  # [groups]
    chosen = [g for _, g in _groups_in_order([keys], want, world)]
    mine = [chosen[p] for p in slot_positions(len(chosen), slot, rank, world)]
    return batch.select(torch.tensor([g * n + i for g in mine for i in range(n)], dtype=torch.long))


def place_groups(batch: Batch, n: int, want: int, slot: int, group: dist.ProcessGroup,
                 comm_device: torch.device) -> Batch:
    """This rank's rows of the first ``want`` groups (in global order) of every rank's ``batch`` over
    ``group``: its block of each slot (a collective). Only the groups' order keys travel when every rank
    already holds its share; otherwise every rank's rows are all-gathered (non-tensor fields as JSON) and
    each keeps its own."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    keys = batch["order"].view(-1, n)[:, 0].to(comm_device)  # [groups]
    counts = [torch.zeros(1, dtype=torch.long, device=comm_device) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([len(keys)], device=comm_device), group=group)
    most = max(int(c) for c in counts)
    padded = torch.full((most,), -1, dtype=torch.long, device=comm_device)
    padded[: len(keys)] = keys
    every = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(every, padded, group=group)
    per_rank = [e[: int(c)].tolist() for e, c in zip(every, counts)]
    chosen = _groups_in_order(per_rank, want, world)
    shares = [[chosen[p] for p in slot_positions(len(chosen), slot, r, world)] for r in range(world)]
    if all(share == [(r, g) for g in range(len(share))] for r, share in enumerate(shares)):
        # Each rank's share is its own first groups, in order: nothing moves.
        return batch.select(slice(0, len(shares[rank]) * n))
    # Every rank's rows, padded to the most groups by repeating its first row (never chosen).
    missing = (most - int(counts[rank])) * n
    fill = torch.cat([torch.arange(len(batch)), torch.zeros(missing, dtype=torch.long)])
    everyone = gather_rows(batch.select(fill), group, comm_device)  # [world * most * n, ...]
    rows = torch.tensor([(r * most + g) * n + i for r, g in shares[rank] for i in range(n)], dtype=torch.long)
    placed = trim_padding(everyone.select(rows))
    if batch.non_tensor:
        # As split placement's messages: a value JSON lacks (a numpy scalar in extra_info) travels as its
        # text.
        mine = json.dumps(batch.non_tensor, default=str).encode()
        lists = [json.loads(p) for p in gather_bytes(mine, group, comm_device)]
        for key in batch.non_tensor:
            placed[key] = [lists[r][key][g * n + i] for r, g in shares[rank] for i in range(n)]
    return placed
