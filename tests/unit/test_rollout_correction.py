"""Rollout correction (verl's algorithm.rollout_correction): weights, rejection, veto and diagnostics
against the formulas written out by hand, and its place in the actor's loss."""

import math

import pytest
import torch

from spmdrl.algos.rollout_correction import rollout_correction
from spmdrl.batch import Batch
from spmdrl.config import Config
from spmdrl.engines.base import LossScale
from spmdrl.objectives import actor_loss_fn

MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.float32)  # a padding row
ROLLOUT = torch.log(torch.tensor([[0.5, 0.2, 0.4, 0.9], [0.3, 0.6, 0.9, 0.9], [0.5, 0.5, 0.5, 0.5]]))
# Training log-probs: ratios 1.0, 3.0, 0.6 | 0.1, 1.2 on the valid tokens; padding differs wildly.
TRAIN = ROLLOUT + torch.log(torch.tensor([[1.0, 3.0, 0.6, 50.0], [0.1, 1.2, 1e-6, 7.0],
                                          [9.0, 9.0, 9.0, 9.0]]))
RATIOS = [[1.0, 3.0, 0.6], [0.1, 1.2]]


def _run(**kw):
    return rollout_correction(TRAIN, ROLLOUT, MASK, **kw)


def test_diagnostics_are_the_formulas_over_valid_tokens_only():
    w, kept, m = _run()
    assert w is None and torch.equal(kept, MASK)
    lr = [math.log(r) for row in RATIOS for r in row]
    assert m["rollout_corr/kl"] == pytest.approx(sum(-x for x in lr) / 5, rel=1e-5)
    assert m["rollout_corr/k3_kl"] == pytest.approx(sum(math.exp(x) - x - 1 for x in lr) / 5, rel=1e-5)
    assert m["rollout_corr/chi2_token"] == pytest.approx(sum(math.exp(2 * x) for x in lr) / 5 - 1, rel=1e-5)
    seq_lr = [sum(math.log(r) for r in row) for row in RATIOS]
    assert m["rollout_corr/chi2_seq"] == pytest.approx(sum(math.exp(2 * s) for s in seq_lr) / 2 - 1, rel=1e-5)
    # log(ppl_train / ppl_rollout) per response = mean(rollout logp) - mean(train logp) = -mean(log ratio)
    diffs = [-s / len(row) for s, row in zip(seq_lr, RATIOS)]
    assert m["rollout_corr/log_ppl_diff"] == pytest.approx(sum(diffs) / 2, rel=1e-5)
    assert m["rollout_corr/ppl_ratio"] == pytest.approx(sum(math.exp(d) for d in diffs) / 2, rel=1e-5)
    assert m["rollout_corr/log_ppl_diff_max"] == pytest.approx(max(diffs), rel=1e-5)
    train_ppl = [math.exp(-float(TRAIN[i, :len(row)].mean())) for i, row in enumerate(RATIOS)]
    assert m["rollout_corr/training_ppl"] == pytest.approx(sum(train_ppl) / 2, rel=1e-5)


def test_token_tis_truncates_each_tokens_ratio_and_counts_the_capped_share():
    w, kept, m = _run(rollout_is="token", rollout_is_threshold=2.0)
    expected = torch.tensor([[1.0, 2.0, 0.6, 0.0], [0.1, 1.2, 0.0, 0.0], [0.0] * 4])
    torch.testing.assert_close(w, expected)
    assert torch.equal(kept, MASK)  # weighting rejects nothing
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)  # the 3.0, capped
    assert m["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(1 / 5)  # the 0.1 (< 1/2)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(3.0, rel=1e-5)
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(0.1, rel=1e-5)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx((1 + 3 + 0.6 + 0.1 + 1.2) / 5, rel=1e-5)
    # ESS of the weights clamped to [0.5, 2]: mean^2 / mean of squares
    c = [1.0, 2.0, 0.6, 0.5, 1.2]
    ess = (sum(c) / 5) ** 2 / (sum(x * x for x in c) / 5)
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(ess, rel=1e-5)


def test_sequence_tis_uses_the_product_of_the_responses_ratios():
    w, _, m = _run(rollout_is="sequence", rollout_is_threshold=2.0)
    # products: 1.8 (under the cap), 0.12
    torch.testing.assert_close(w[0], torch.tensor([1.8, 1.8, 1.8, 0.0]))
    torch.testing.assert_close(w[1], torch.tensor([0.12, 0.12, 0.0, 0.0]))
    assert m["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(1 / 2)  # per response


def test_batch_normalize_gives_weights_of_mean_one():
    w, _, m = _run(rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True)
    assert float(w[MASK.bool()].mean()) == pytest.approx(1.0, rel=1e-5)
    assert m["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx((1 + 2 + 0.6 + 0.1 + 1.2) / 5)


@pytest.mark.parametrize("level, kept_rows", [
    ("token", [[1, 0, 1, 0], [0, 1, 0, 0]]),  # 3.0 and 0.1 are outside [1/2.5, 2.5]
    ("sequence", [[1, 1, 1, 0], [0, 0, 0, 0]]),  # products 1.8 in, 0.12 out
    ("geometric", [[1, 1, 1, 0], [1, 1, 0, 0]]),  # 1.8^(1/3) = 1.22 and 0.12^(1/2) = 0.35 in [0.3, 2.5]
])
def test_rejection_levels(level, kept_rows):
    lower = 0.3 if level == "geometric" else None
    _, kept, m = _run(rollout_rs=level, rollout_rs_threshold=2.5, rollout_rs_threshold_lower=lower)
    torch.testing.assert_close(kept[:2], torch.tensor(kept_rows, dtype=torch.float32))
    rejected = 5 - sum(map(sum, kept_rows))
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(rejected / 5)


def test_veto_drops_a_whole_response_holding_one_catastrophic_token():
    _, kept, m = _run(rollout_token_veto_threshold=0.2)
    torch.testing.assert_close(kept, torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]],
                                                  dtype=torch.float32))
    assert m["rollout_corr/rollout_is_veto_fraction"] == pytest.approx(1 / 2)
    assert m["rollout_corr/rollout_is_catastrophic_token_fraction"] == pytest.approx(1 / 5)


def test_the_loss_weights_each_tokens_clipped_term():
    cfg = Config()
    loss_fn = actor_loss_fn(cfg)
    g = torch.Generator().manual_seed(0)
    logp = torch.log(torch.rand(3, 4, generator=g))
    mb = Batch({"response_mask": MASK, "old_logp": logp + 0.3 * torch.randn(3, 4, generator=g),
                "advantages": torch.randn(3, 4, generator=g), "ref_logp": logp})
    scale = LossScale(global_tokens=5.0, global_seqs=2.0)
    weights = torch.tensor([[1.0, 2.0, 0.6, 0.0], [0.1, 1.2, 0.0, 0.0], [0.0] * 4])
    plain, _ = loss_fn({"logp": logp}, mb, scale)
    mb["rollout_is_weights"] = weights
    weighted, _ = loss_fn({"logp": logp}, mb, scale)
    # Per token: a weight of 2 on every token doubles the loss; the given weights move it.
    mb["rollout_is_weights"] = 2 * MASK
    doubled, _ = loss_fn({"logp": logp}, mb, scale)
    assert float(doubled) == pytest.approx(2 * float(plain), rel=1e-5)
    assert float(weighted) != pytest.approx(float(plain), rel=1e-3)


def test_one_pass_loss_logs_the_gap_from_its_own_forward():
    loss_fn = actor_loss_fn(Config())
    mb = Batch({"response_mask": MASK, "rollout_logp": ROLLOUT, "advantages": torch.zeros(3, 4),
                "ref_logp": TRAIN})
    _, metrics = loss_fn({"logp": TRAIN}, mb, LossScale(global_tokens=5.0, global_seqs=2.0))
    _, _, full = _run()
    assert metrics["rollout_corr/kl"] == pytest.approx(full["rollout_corr/kl"])
    assert not any(k.endswith(("_max", "_min")) for k in metrics)  # micro-batch extremes would be averaged


@pytest.mark.parametrize("truncation", [("top_p", 0.9), ("top_k", 50)])
def test_no_diagnostics_under_top_p_or_top_k(truncation):
    """Sampled from a truncated distribution, the rollout's log-probs are not the actor's to compare with
    (rollout/sampling.py): neither the one-pass loss nor the loop logs rollout_corr/* then."""
    from types import SimpleNamespace

    from spmdrl.run.learn import _rollout_correction

    cfg = Config()
    setattr(cfg.rollout, *truncation)
    mb = Batch({"response_mask": MASK, "rollout_logp": ROLLOUT, "advantages": torch.zeros(3, 4),
                "ref_logp": TRAIN})
    _, metrics = actor_loss_fn(cfg)({"logp": TRAIN}, mb, LossScale(global_tokens=5.0, global_seqs=2.0))
    assert not [k for k in metrics if k.startswith("rollout_corr/")]
    mb["old_logp"] = TRAIN
    assert _rollout_correction(SimpleNamespace(cfg=cfg, group=None), mb) == (None, {})
