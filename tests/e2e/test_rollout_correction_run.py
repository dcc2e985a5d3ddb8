"""Rollout correction under torchrun: its diagnostics are logged, and its rejection reaches the loss (in the
shared jobs, tests/e2e/shared_runs.py)."""

from __future__ import annotations

import pytest
from conftest import TINY
from shared_runs import declare

pytestmark = pytest.mark.e2e
RC = "--algorithm.rollout_correction."


# Ratios near 1 are all outside [1e8, 1e9]: every token is rejected, so no loss term has a gradient.
declare("rollout_correction", ["--config", "configs/grpo.yaml", *TINY, "--trainer.total_steps", "2",
                               "--trainer.output_dir", "{base}/rollout_correction",
                               f"{RC}rollout_is", "token", f"{RC}rollout_rs", "token",
                               f"{RC}rollout_rs_threshold", "1e9", f"{RC}rollout_rs_threshold_lower", "1e8"])


def test_rejecting_every_token_leaves_nothing_to_train(shared):
    rows = shared.rows("rollout_correction")
    assert len(rows) == 2
    for row in rows:
        assert row["rollout_corr/rollout_rs_masked_fraction"] == 1.0
        assert row["actor/grad_norm"] == 0.0
        assert row["actor/pg_loss"] == 0.0
        assert 0.5 < row["rollout_corr/rollout_is_mean"] < 2.0  # the weights are measured all the same
        assert row["rollout_corr/ppl_ratio"] > 0 and "rollout_corr/kl" in row
    assert rows[0]["response_length/mean"] > 0  # the lengths are of the responses, not of the kept tokens
