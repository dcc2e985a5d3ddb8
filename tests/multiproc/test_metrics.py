"""Metric reduction over ranks that report different keys."""

import pytest
import torch.distributed as dist
from dist_utils import spawn

from spmdrl.metrics import reduce_metrics

pytestmark = pytest.mark.dist


def _reduce(rank, world_size):
    metrics = {"reward/mean": float(rank), "reward/max": float(rank), "reward/min": float(rank) + 1,
               "timing/step": 1.0 + rank, "batch/responses": 16.0, "reward/num_errors": float(rank)}
    if rank == 1:
        metrics["reward/acc"] = 0.5  # only rank 1's scorer reported it
    return reduce_metrics(metrics, dist.group.WORLD)


def test_reduce_metrics_with_mismatched_keys():
    a, b = spawn(_reduce, 2)
    assert a == b
    # Counts are summed: the two ranks' 16 responses are the batch's 32, as one rank logs them.
    assert a == {"reward/mean": 0.5, "reward/max": 1.0, "reward/min": 1.0, "timing/step": 2.0,
                 "reward/acc": 0.5, "batch/responses": 32.0, "reward/num_errors": 1.0}
