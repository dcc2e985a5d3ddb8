"""``TrainEngine.train_step`` on one rank: the learning-rate schedule counts training steps (as verl's, which
steps its scheduler once per update call), whatever the mini-batches and epochs inside a step."""

from __future__ import annotations

from pathlib import Path

import pytest
from rows import fsdp2_engine, pg_loss, rows_with_lengths

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
