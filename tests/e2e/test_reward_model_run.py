"""reward_model.enable end to end: 2 steps on 2 ranks under torchrun with the tiny reward model, its score
mixed with the rule score, and validation whose last batch leaves one rank without prompts (the reward
model's forward is collective, so that rank must still take part)."""

from __future__ import annotations

import math

import pytest
from conftest import TINY, read_metrics, train

pytestmark = pytest.mark.e2e


def test_reward_model_and_rule_score_two_ranks(tmp_path, spmdrl_cache) -> None:
    from spmdrl.builtin.tasks import get_task, write_parquet

    # batches of 4 then 1 prompt
    val = write_parquet(get_task("arith")("val", 5, 0), tmp_path / "val.parquet")
    out = tmp_path / "run"
    train([*TINY, "--trainer.total_steps", "2", "--rollout.n", "2", "--reward_model.enable", "true",
           "--reward_model.model.path", "builtin:tiny-rm", "--reward_model.rule_weight", "0.5",
           "--reward_model.micro_batch_size_per_gpu", "3", "--data.val_files", str(val),
           "--data.val_batch_size", "4", "--trainer.test_freq", "2", "--trainer.output_dir", str(out)],
          cache=spmdrl_cache, nproc=2)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        rm, rule = row["reward/rm_score/mean"], row["reward/rule_score/mean"]
        # Equal rows per rank: the mean of rm + 0.5 * rule is the combination of the means.
        assert math.isclose(row["reward/mean"], rm + 0.5 * rule, rel_tol=1e-5, abs_tol=1e-6), row
        assert rm != 0.0  # the random head scores every text differently from 0
    assert "val-core/spmdrl/arith/acc/mean@1" in rows[1]  # the rule ran too, so its acc is the core variable
    assert "val-aux/spmdrl/arith/reward/mean@1" in rows[1]
