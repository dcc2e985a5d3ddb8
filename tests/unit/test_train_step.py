"""``TrainEngine.train_step`` on one rank: the learning-rate schedule counts training steps (as verl's, which
steps its scheduler once per update call), whatever the mini-batches and epochs inside a step; the loss
denominators count a fully masked row."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rows import fsdp2_engine, pg_loss, rows_with_lengths

from spmdrl.algos.losses import agg_loss
from spmdrl.engines.optim import WarmupSchedule

pytestmark = pytest.mark.usefixtures("gloo_world_of_one")


@pytest.mark.parametrize("warmup", [0, 2])
def test_the_schedule_advances_once_per_training_step(tiny_model_dir: Path, warmup: int) -> None:
    """3 training steps of 3 mini-batches x 2 epochs each (6 optimizer steps): the cosine over 3 steps is at
    its start, middle and floor, not at the floor from the second step on."""
    engine = fsdp2_engine(tiny_model_dir, lr_warmup_steps=warmup, lr_scheduler="cosine", min_lr_ratio=0.1,
                          total_steps=3)
    batch = rows_with_lengths([4, 2, 6, 3, 5, 1], [3, 5, 2, 4, 1, 6], 2048, seed=0)
    lrs = [engine.train_step(batch, pg_loss, mini_batch_size=2, micro_batch_size=1, epochs=2)["actor/lr"]
           for _ in range(3)]
    schedule = WarmupSchedule(warmup, "cosine", 0.1, 3)
    assert lrs == pytest.approx([1e-4 * schedule(step) for step in range(3)])
    assert engine.global_step == 18 and engine.scheduler.last_epoch == 3


def test_the_loss_scale_counts_a_fully_masked_row(tiny_model_dir: Path) -> None:
    """A response rejected whole (``algorithm.rollout_correction.rollout_rs``) is still a sequence of the
    mini-batch (verl 0.9's ``global_batch_size``): the engine's ``LossScale`` and ``agg_loss`` without global
    counts (both ``loss_denominators``) divide the seq-mean modes by every row."""
    engine = fsdp2_engine(tiny_model_dir)
    batch = rows_with_lengths([4, 2, 3], [3, 5, 2], 2048, seed=0)
    batch["response_mask"][1] = 0.0  # [3, 5]: 3, 0 and 2 valid tokens
    scale = engine._loss_scale(batch)
    assert (scale.global_tokens, scale.global_seqs) == (5.0, 3.0)
    loss_mat = torch.arange(15.0).view(3, 5)  # valid: 0 1 2 in row 0, 10 11 in row 2
    expected = {"token-mean": (3 + 21) / 5, "seq-mean-token-sum": (3 + 0 + 21) / 3,
                "seq-mean-token-mean": (1 + 0 + 10.5) / 3,
                "seq-mean-token-sum-norm": (3 / 5 + 0 + 21 / 5) / 3}
    mask = batch["response_mask"]
    counts = dict(global_tokens=scale.global_tokens, global_seqs=scale.global_seqs)
    for mode, value in expected.items():
        assert float(agg_loss(loss_mat, mask, mode, **counts, norm_len=5)) == pytest.approx(value), mode
        assert float(agg_loss(loss_mat, mask, mode, norm_len=5)) == pytest.approx(value), mode
