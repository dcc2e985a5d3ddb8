"""Rows placed on ranks by tokens (verl's ``trainer.balance_batch``).

Every rank generates the responses to its own prompts, so one rank may end up with the long answers and
wait for the others in every collective of old-log-prob, reference, value and update passes. After the
rollout, ``balance_rows`` moves whole groups (the n responses of one prompt) between ranks so each holds
about the same number of attended tokens:

- **Whole groups**: group statistics (GRPO, RLOO, ...) are computed on the rank that holds the group, so
  they stay exact; batch-wide statistics are all-reduced already and do not care where rows are.
- **Mini-batches keep their rows**: groups are exchanged only within one mini-batch slot (the m-th
  mini-batch of every rank), so the union of the rows in each global mini-batch, and with the global loss
  denominators the update itself, is the same with and without balancing.
- **Every rank keeps as many rows**: the update's collectives need as many mini-batches everywhere.
- **Every trained model's mini-batches**: with a critic whose mini-batch differs from the actor's, a slot is
  their greatest common divisor (``balance_slot``), so it lies inside one mini-batch of each.

The plan is computed by every rank from the same all-gathered lengths (no leader, no pickling): in each
slot, groups by descending tokens go to the lightest rank that still has room (greedy LPT with equal
counts, as verl's equal-size partitions).
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import torch
import torch.distributed as dist

from spmdrl.batch import Batch
from spmdrl.engines.base import gather_rows


def plan_groups(tokens: list[list[int]], slot_groups: int) -> list[list[int]]:
    """Which groups each rank gets. ``tokens[r][g]`` is the attended tokens of rank r's g-th group; every
    rank has as many groups, taken ``slot_groups`` at a time as one mini-batch slot. Returns, per rank,
    global group ids (``r * groups_per_rank + g``) slot by slot, each rank the same number per slot."""
    ranks, per_rank = len(tokens), len(tokens[0])
    out: list[list[int]] = [[] for _ in range(ranks)]
    for start in range(0, per_rank, slot_groups):
        stop = min(start + slot_groups, per_rank)
        ids = [r * per_rank + g for r in range(ranks) for g in range(start, stop)]
        room = len(ids) // ranks
        load, taken = [0] * ranks, [[] for _ in range(ranks)]
        # Longest first; ties by id so every rank computes the same plan.
        for gid in sorted(ids, key=lambda i: (-tokens[i // per_rank][i % per_rank], i)):
            r = min((r for r in range(ranks) if len(taken[r]) < room), key=lambda r: (load[r], r))
            taken[r].append(gid)
            load[r] += tokens[gid // per_rank][gid % per_rank]
        for r in range(ranks):
            out[r].extend(sorted(taken[r]))  # the slot's groups in their original order
    return out


def balance_slot(mini_rows: Sequence[int]) -> int:
    """Rows per rank of one balancing slot, given each trained model's mini-batch rows per rank: the largest
    slot inside one mini-batch of every model."""
    return functools.reduce(math.gcd, mini_rows)


def balance_rows(batch: Batch, group_size: int, mini_rows: int, group: dist.ProcessGroup,
                 comm_device: torch.device) -> tuple[Batch, dict[str, float]]:
    """This rank's rows after balancing (tensor fields only: non-tensor ones are dropped, the passes
    after the rollout read tensors) and ``perf/balance_{before,after}``: the most tokens on one rank over
    the mean. Only group token counts travel until a plan beats the current placement; then every rank's
    rows are all-gathered and each keeps its own. ``group_size`` rows make a group (rollout.n,
    consecutive); ``mini_rows`` rows per rank make a mini-batch. When a mini-batch is not a whole number of
    groups, the whole batch is one slot."""
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = len(batch)
    index = batch["index"].view(-1, group_size)  # [groups, n]
    if not bool((index == index[:, :1]).all()):
        raise RuntimeError("balance_batch needs each prompt's responses on consecutive rows")
    slot = mini_rows // group_size if mini_rows % group_size == 0 and mini_rows < rows else rows // group_size
    mine = batch["attention_mask"].sum(1).view(-1, group_size).sum(1).to(comm_device)  # [groups]
    every = [torch.empty_like(mine) for _ in range(ranks)]
    dist.all_gather(every, mine, group=group)
    tokens = [t.tolist() for t in every]  # [ranks][groups per rank]
    plan = plan_groups(tokens, max(slot, 1))
    flat = [t for per_rank in tokens for t in per_rank]
    mean = sum(flat) / ranks
    before = max(sum(t) for t in tokens)
    after = max(sum(flat[g] for g in gids) for gids in plan)
    if after >= before:  # the placement is as good already: no exchange
        return Batch(batch.tensors), _ratios(before, before, mean)
    everyone = gather_rows(batch, group, comm_device)  # [ranks * rows, ...], rank r's rows at r * rows
    rows_of = torch.tensor([g * group_size + i for g in plan[rank] for i in range(group_size)])
    return trim_padding(everyone.select(rows_of)), _ratios(before, after, mean)


def _ratios(before: float, after: float, mean: float) -> dict[str, float]:
    return {"perf/balance_before": before / mean, "perf/balance_after": after / mean}


def trim_padding(batch: Batch) -> Batch:
    """``batch`` without the prompt-padding columns on the left and the response-padding columns on the
    right that none of its rows attend to (rows gathered from other ranks come padded to the widest)."""
    attn, resp = batch["attention_mask"], batch["response_mask"].shape[1]  # [N, P+R], R
    prompt = attn.shape[1] - resp
    used = attn.bool().any(0)  # [P+R]
    first = int(used[:prompt].nonzero().min()) if used[:prompt].any() else prompt
    last = int(used[prompt:].nonzero().max()) + 1 if used[prompt:].any() else 0
    out = {}
    for key, v in batch.tensors.items():
        if v.dim() >= 2 and v.shape[1] == prompt + resp:
            v = v[:, first : prompt + last].contiguous()
        elif v.dim() >= 2 and v.shape[1] == resp:
            v = v[:, :last].contiguous()
        out[key] = v
    return Batch(out)
