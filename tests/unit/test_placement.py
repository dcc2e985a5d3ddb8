"""Which prompts each rank holds (spmdrl/placement.py): every global mini-batch the same prompts at any
world size."""

from __future__ import annotations

import torch

from spmdrl.batch import Batch
from spmdrl.config import Config
from spmdrl.placement import own_groups, slot_positions, slot_prompts


def _minis(batch: int, slot: int, mini: int, world: int) -> list[set[int]]:
    """The global mini-batches (sets of global positions) that ranks cutting their own rows into mini-batches
    of mini / world train on."""
    shares = [slot_positions(batch, slot, r, world) for r in range(world)]
    per = mini // world
    return [{p for s in shares for p in s[j * per:(j + 1) * per]} for j in range(batch // mini)]


def test_every_global_mini_batch_holds_the_same_prompts_at_any_world_size():
    for world in (1, 2, 4):
        assert _minis(16, 4, 4, world) == [set(range(j * 4, j * 4 + 4)) for j in range(4)], world
    # A rank's block of each slot, slot after slot.
    assert slot_positions(8, 4, 1, 2) == [2, 3, 6, 7]
    assert slot_positions(8, 8, 1, 2) == [4, 5, 6, 7]  # one slot: today's contiguous blocks
    # A slot the world does not divide cannot be shared evenly: contiguous blocks of the whole batch.
    assert slot_positions(8, 2, 0, 4) == [0, 1] and slot_positions(6, 3, 1, 2) == [3, 4, 5]


def test_the_slot_lies_inside_one_mini_batch_of_every_trained_model():
    cfg = Config()
    cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size, cfg.critic.ppo_mini_batch_size = 24, 8, 6
    assert slot_prompts(cfg, critic=False) == 8 and slot_prompts(cfg, critic=True) == 2
    cfg.algorithm.adv_estimator = "gae"  # the estimator decides whether a critic trains
    assert slot_prompts(cfg) == 2


def test_a_rank_holding_every_row_takes_its_share_of_the_first_groups_in_order():
    """Split placement's training ranks: rows from any number of rollout ranks, in any order, give each
    training rank the first groups in global order, its block of each slot, whole groups."""
    n, order = 2, [5, 1, 4, 0, 3, 2, 7, 6]  # groups as the rollout ranks sent them
    batch = Batch({"order": torch.tensor([o for o in order for _ in range(n)]),
                   "x": torch.arange(len(order) * n)}, {"tag": [f"g{o}" for o in order for _ in range(n)]})
    shares = [own_groups(batch, n, want=6, slot=4, rank=r, world=2) for r in range(2)]
    assert [s["order"].tolist() for s in shares] == [[0, 0, 1, 1, 4, 4], [2, 2, 3, 3, 5, 5]]
    assert shares[1]["tag"] == ["g2", "g2", "g3", "g3", "g5", "g5"]  # non-tensor fields come along
    # A number of groups the training ranks do not divide: the last ones are dropped.
    assert own_groups(batch, n, want=7, slot=8, rank=0, world=2)["order"].tolist() == [0, 0, 1, 1, 2, 2]
