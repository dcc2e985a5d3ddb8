"""Groups placed on their ranks over gloo (spmdrl/placement.py): DAPO's kept groups, uneven over the ranks
and out of order, become each rank's block of every slot of the first groups in global order, with their
prompts, responses and non-tensor fields; a placement that is right already moves nothing."""

import pytest
import torch
import torch.distributed as dist
from dist_utils import spawn

pytestmark = pytest.mark.dist

N = 2  # responses per prompt


def _rows(orders: list[int], prompt_width: int):
    from spmdrl.batch import Batch

    rows = len(orders) * N
    P, R = prompt_width, 3
    order = torch.tensor([o for o in orders for _ in range(N)])
    ids = order.view(-1, 1).expand(rows, P + R) * 10 + torch.arange(P + R)  # each row tells its group
    attention = torch.ones(rows, P + R, dtype=torch.long)
    return Batch({"input_ids": ids, "attention_mask": attention, "position_ids": attention.cumsum(1) - 1,
                  "response_mask": torch.ones(rows, R), "order": order},
                 {"ground_truth": [f"gt{o}" for o in order.tolist()]})


def _place(rank: int, world: int) -> dict:
    from spmdrl.placement import place_groups

    # DAPO kept 3 groups on rank 0 and 5 on rank 1, interleaved in global order, prompts of other widths.
    kept = {0: [6, 0, 3], 1: [1, 2, 4, 5, 7]}[rank]
    placed = place_groups(_rows(kept, 4 + rank), N, want=6, slot=4, group=dist.group.WORLD,
                          comm_device=torch.device("cpu"))
    ids = placed["input_ids"]
    # Already placed: the loader's blocks of each slot (rank 0 holds 0, 1, 4; rank 1 2, 3, 5 of 6) stay put.
    mine = {0: [0, 1, 4, 5], 1: [2, 3, 6, 7]}[rank]
    same = place_groups(_rows(mine, 4), N, want=8, slot=4, group=dist.group.WORLD,
                        comm_device=torch.device("cpu"))
    return {"order": placed["order"].tolist(), "first_id": (ids[:, -4] // 10).tolist(),
            "gt": placed["ground_truth"], "width": ids.shape[1], "same": same["order"].tolist()}


def test_dapo_groups_move_to_their_slot_blocks():
    out = spawn(_place, 2)
    # The first 6 groups in global order (0..5), slots of 4 prompts: rank 0 keeps 0, 1 and 4, rank 1 2, 3, 5.
    assert [o["order"] for o in out] == [[0, 0, 1, 1, 4, 4], [2, 2, 3, 3, 5, 5]]
    assert [o["first_id"] for o in out] == [o["order"] for o in out]  # the rows came with their group
    assert [o["gt"] for o in out] == [[f"gt{g}" for g in o["order"]] for o in out]
    assert [o["same"] for o in out] == [[0, 0, 1, 1, 4, 4, 5, 5], [2, 2, 3, 3, 6, 6, 7, 7]]
