"""Rollout correction under torchrun: its diagnostics are logged, and its rejection reaches the loss."""

from __future__ import annotations

import pytest
from conftest import TINY, read_metrics, train

pytestmark = pytest.mark.e2e
RC = "--algorithm.rollout_correction."


def test_rejecting_every_token_leaves_nothing_to_train(tmp_path, spmdrl_cache):
    # Ratios near 1 are all outside [1e8, 1e9]: every token is rejected, so no loss term has a gradient.
    out = tmp_path / "run"
    train(["--config", "configs/grpo.yaml", *TINY, "--trainer.total_steps", "2",
           "--trainer.output_dir", str(out), f"{RC}rollout_is", "token", f"{RC}rollout_rs", "token",
           f"{RC}rollout_rs_threshold", "1e9", f"{RC}rollout_rs_threshold_lower", "1e8"],
          cache=spmdrl_cache, nproc=2)
    rows = read_metrics(out)
    assert len(rows) == 2
    for row in rows:
        assert row["rollout_corr/rollout_rs_masked_fraction"] == 1.0
        assert row["actor/grad_norm"] == 0.0
        assert row["actor/pg_loss"] == 0.0
        assert 0.5 < row["rollout_corr/rollout_is_mean"] < 2.0  # the weights are measured all the same
        assert row["rollout_corr/ppl_ratio"] > 0 and "rollout_corr/kl" in row
    assert rows[0]["response_length/mean"] > 0  # the lengths are of the responses, not of the kept tokens
