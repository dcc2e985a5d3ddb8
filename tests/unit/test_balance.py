"""trainer.balance_batch's plan (which rank gets which group) and the padding trim after the exchange; the
2-rank exchange and its update are tested in tests/multiproc/test_balance_dist.py."""

from __future__ import annotations

import torch

from spmdrl.batch import Batch
from spmdrl.engines.balance import plan_groups, trim_padding


def test_plan_evens_tokens_with_equal_counts_per_slot():
    tokens = [[90, 80, 70, 60], [5, 4, 3, 2]]  # rank 0 holds every long group
    plan = plan_groups(tokens, slot_groups=2)
    flat = [t for per_rank in tokens for t in per_rank]
    loads = [sum(flat[g] for g in gids) for gids in plan]
    assert max(loads) - min(loads) < 30 and sorted(loads) != sorted(map(sum, tokens))
    # Slot 0 holds groups 0, 1 of each rank (ids 0, 1, 4, 5), slot 1 the others; two per rank per slot.
    for gids in plan:
        assert len(gids) == 4 and set(gids[:2]) <= {0, 1, 4, 5} and set(gids[2:]) <= {2, 3, 6, 7}
    assert sorted(sum(plan, [])) == list(range(8))


def test_plan_is_the_same_on_every_rank_and_keeps_slot_order():
    tokens = [[7, 7, 7], [7, 7, 7], [7, 7, 7]]  # ties everywhere: broken by group id
    assert plan_groups(tokens, 3) == plan_groups([list(t) for t in tokens], 3)
    assert all(gids == sorted(gids) for gids in plan_groups(tokens, 3))


def test_trim_drops_columns_no_row_attends():
    attn = torch.tensor([[0, 0, 1, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1, 0]])  # P=4, R=3; column 0, 1, 6 unused
    b = Batch(dict(input_ids=torch.arange(14).view(2, 7), attention_mask=attn,
                   response_mask=attn[:, 4:].float(), index=torch.tensor([3, 3])))
    t = trim_padding(b)
    assert t["attention_mask"].tolist() == [[1, 1, 1, 0], [0, 1, 1, 1]]
    assert t["input_ids"].tolist() == [[2, 3, 4, 5], [9, 10, 11, 12]]
    assert t["response_mask"].tolist() == [[1.0, 0.0], [1.0, 1.0]] and t["index"].tolist() == [3, 3]
