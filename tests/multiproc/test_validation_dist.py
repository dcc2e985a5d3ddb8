"""Validation metrics over 2 gloo ranks equal those of one process holding every prompt."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from dist_utils import spawn

pytestmark = pytest.mark.dist

# Three prompts (uids) of two sources, 4 responses each; rank 0 gets prompts 0 and 2, rank 1 prompt 1.
SOURCES = ["a"] * 8 + ["b"] * 4
UIDS = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
INFOS = {
    "reward": [0.9, 0.1, 0.1, 0.9, 0.5, 0.2, 0.5, 0.5, 1.0, 0.0, 1.0, 0.0],
    "acc": [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, None, None, None, None],
    "pred": ["7", "3", "3", "7", "1", "2", "1", "1", "x", "y", "x", "y"],
}


def _rank_metrics(rank: int, world_size: int) -> dict:
    from spmdrl.validation import all_reduce_sums, local_sums, name_metrics

    mine = [i for i, u in enumerate(UIDS) if (u == 1) == (rank == 1)]  # all responses of a prompt on one rank
    sums = local_sums([SOURCES[i] for i in mine], [UIDS[i] for i in mine],
                      {k: [v[i] for i in mine] for k, v in INFOS.items()})
    return name_metrics(all_reduce_sums(sums, dist.group.WORLD))


def test_two_ranks_equal_one_process() -> None:
    from spmdrl.validation import local_sums, name_metrics

    whole = name_metrics(local_sums(SOURCES, UIDS, INFOS))
    per_rank = spawn(_rank_metrics, 2)
    assert per_rank[0] == per_rank[1]  # every rank logs the same numbers
    assert per_rank[0].keys() == whole.keys()
    for key, value in whole.items():
        assert per_rank[0][key] == pytest.approx(value, abs=1e-12), key
    assert whole["val-core/a/acc/mean@4"] == pytest.approx((0.5 + 0.25) / 2)
