"""The README's main job, shortened: GRPO under torchrun on 2 CPU ranks, and the reward rises."""

import pytest
from conftest import read_metrics, train

pytestmark = pytest.mark.e2e


def test_grpo_reward_rises(tmp_path, spmdrl_cache):
    out = tmp_path / "grpo"
    run = train(["--config", "configs/grpo.yaml", "--trainer.total_steps", "12",
                 "--trainer.progress_bar", "false", "--trainer.resume", "off",
                 "--trainer.output_dir", str(out)], cache=spmdrl_cache, nproc=2)
    assert "[rank 1/2]" in run.stdout and "[rank 0/2]" in run.stdout  # one start-up line per rank
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 13))
    first = sum(r["reward/mean"] for r in rows[:3]) / 3
    last = sum(r["reward/mean"] for r in rows[-3:]) / 3
    # Random init scores ~0.02; GRPO learns to answer with digits within a dozen steps (~0.2 here).
    assert last > first + 0.05, [round(r["reward/mean"], 3) for r in rows]
    assert rows[-1]["actor/entropy"] < rows[0]["actor/entropy"]
