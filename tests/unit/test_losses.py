"""Loss aggregation, policy losses and the value loss against hand-computed values."""

import math

import pytest
import torch

import spmdrl.algos  # noqa: F401  (fills the registries)
from spmdrl.algos.losses import agg_loss, loss_denominators, value_loss
from spmdrl.algos.registry import POLICY_LOSSES, get_policy_loss

T = torch.tensor


def close(actual, expected, atol=1e-5):
    actual = torch.as_tensor(actual)
    torch.testing.assert_close(actual, T(expected, dtype=actual.dtype), atol=atol, rtol=0)


# --- agg_loss --------------------------------------------------------------------------------------

LOSS = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = T([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the last row is fully masked (a response rejected whole)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 4) / 3),
        # The fully masked row is a sequence (verl 0.9 divides by the mini-batch's rows): 3 of them.
        ("seq-mean-token-sum", (3 + 4 + 0) / 3),
        ("seq-mean-token-mean", (1.5 + 4 + 0) / 3),
        ("seq-mean-token-sum-norm", (3 / 3 + 4 / 3 + 0) / 3),  # norm_len defaults to T = 3
    ],
)
def test_agg_loss_local_means(mode, expected):
    close(agg_loss(LOSS, MASK, mode), expected)


def test_agg_loss_global_denominators():
    close(agg_loss(LOSS, MASK, "token-mean", global_tokens=7), 1.0)
    close(agg_loss(LOSS, MASK, "seq-mean-token-sum", global_seqs=4), 7 / 4)
    close(agg_loss(LOSS, MASK, "seq-mean-token-mean", global_seqs=4), 5.5 / 4)
    close(agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", global_seqs=4, norm_len=10), (0.3 + 0.4) / 4)
    # global_tokens does not touch the seq modes and global_seqs does not touch token-mean
    close(agg_loss(LOSS, MASK, "seq-mean-token-mean", global_tokens=100), 5.5 / 3)
    close(agg_loss(LOSS, MASK, "token-mean", global_seqs=100), 7 / 3)


MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_contributions_of_shards_sum_to_the_whole(mode):
    # Two "ranks" (row shards) with the global counts: their contributions add up to the full-batch mean,
    # also when one rank's only row is fully masked.
    loss = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [0.5, 0.0, 0.0], [2.0, 2.0, 8.0], [9.0, 9.0, 9.0]])
    mask = T([[1, 1, 0], [1, 0, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]])
    tokens, seqs = loss_denominators(mask).tolist()
    assert (tokens, seqs) == (7.0, 5.0)
    parts = [
        agg_loss(loss[rows], mask[rows], mode, global_tokens=tokens, global_seqs=seqs, norm_len=5)
        for rows in (slice(4, 5), slice(0, 4))
    ]
    close(parts[0], 0.0)
    close(sum(parts), agg_loss(loss, mask, mode, norm_len=5).item())


def test_loss_denominators_count_fully_masked_rows():
    counts = loss_denominators(MASK)  # [valid tokens, sequences]
    assert counts.dtype == torch.float64 and counts.tolist() == [3.0, 3.0]
    assert loss_denominators(MASK[:0]).tolist() == [0.0, 0.0]
    close(agg_loss(LOSS[:0], MASK[:0], "seq-mean-token-mean"), 0.0)  # an empty micro-batch gives 0, not NaN


def test_unknown_agg_mode_lists_valid_ones():
    with pytest.raises(ValueError) as err:
        agg_loss(LOSS, MASK, "token-sum")
    assert "actor.loss_agg_mode" in str(err.value)
    assert "seq-mean-token-sum-norm" in str(err.value) and "token-mean" in str(err.value)


def test_agg_loss_docstring_explains_each_mode():
    for mode in MODES:
        assert f'"{mode}"' in agg_loss.__doc__


# --- policy losses ---------------------------------------------------------------------------------

# Four valid tokens and one padded token with a huge advantage that must not count.
ADV = T([[1.0, 1.0, -1.0, -1.0, 100.0]])
RATIOS = [1.5, 0.5, 4.0, 0.5, 7.0]
PG_MASK = T([[1.0, 1.0, 1.0, 1.0, 0.0]])


def _logps(ratios):
    old = T([[-1.0] * len(ratios)])
    logp = (old + torch.log(T([ratios]))).requires_grad_(True)
    return logp, old


def test_vanilla_clip_and_dual_clip():
    logp, old = _logps(RATIOS)
    loss, metrics = get_policy_loss("vanilla")(logp, old, ADV, PG_MASK, clip_ratio_c=3.0)
    # A=+1, r=1.5: max(-1.5, -1.2) = -1.2 (clipped)
    # A=+1, r=0.5: max(-0.5, -0.8) = -0.5
    # A=-1, r=4:   max(4, 1.2) = 4, dual clip min(4, 3) = 3 (hits the lower/dual clip)
    # A=-1, r=0.5: max(0.5, 0.8) = 0.8 (clipped), min(0.8, 3) = 0.8
    close(loss, (-1.2 - 0.5 + 3.0 + 0.8) / 4)
    assert metrics["actor/pg_loss"] == pytest.approx(0.525, abs=1e-6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.5)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(0.25)
    # mean of old - logp = -(ln 1.5 + ln 0.5 + ln 4 + ln 0.5) / 4 = -ln(1.5) / 4
    assert metrics["actor/ppo_kl"] == pytest.approx(-0.1013662770270411, abs=1e-6)
    assert all(isinstance(v, float) for v in metrics.values())
    loss.backward()
    # only the unclipped token has a gradient: d(-A r)/d logp = -r = -0.5, over 4 tokens
    close(logp.grad, [[0.0, -0.125, 0.0, 0.0, 0.0]])


def test_vanilla_clip_higher():
    logp, old = _logps(RATIOS)
    loss, metrics = get_policy_loss("vanilla")(
        logp, old, ADV, PG_MASK, clip_ratio_low=0.2, clip_ratio_high=0.6
    )
    # r=1.5 is now inside [0.8, 1.6]: -1.5; r=4 with A<0: max(4, 1.6) = 4 -> dual 3
    close(loss, (-1.5 - 0.5 + 3.0 + 0.8) / 4)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.25)


def test_vanilla_global_tokens_scale_the_loss_and_its_metric_share():
    from spmdrl.algos.utils import Share

    logp, old = _logps(RATIOS)
    loss, metrics = get_policy_loss("vanilla")(logp, old, ADV, PG_MASK, global_tokens=8)
    close(loss, 2.1 / 8)
    # The metric is this micro-batch's share of the mini-batch's loss: the engine sums the shares.
    assert isinstance(metrics["actor/pg_loss"], Share)
    assert metrics["actor/pg_loss"] == pytest.approx(2.1 / 8, abs=1e-6)


def test_vanilla_seq_mean_token_mean():
    old = T([[-1.0, -1.0], [-1.0, -1.0]])
    logp = old + torch.log(T([[1.0, 1.0], [0.5, 1.0]]))
    adv = T([[1.0, 2.0], [3.0, 3.0]])
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    loss, _ = get_policy_loss("vanilla")(logp, old, adv, mask, loss_agg_mode="seq-mean-token-mean")
    # row 0: -1, -2 -> mean -1.5; row 1: A=3, r=0.5: max(-1.5, -2.4) = -1.5
    close(loss, (-1.5 - 1.5) / 2)


def test_vanilla_clamps_the_log_ratio_at_20():
    old = T([[-30.0]])
    logp = T([[-5.0]], requires_grad=True)  # log ratio 25
    loss, metrics = get_policy_loss("vanilla")(logp, old, T([[-1.0]]), T([[1.0]]), clip_ratio_c=1e12)
    # A=-1: max(r, 1.2) with r = exp(20), not exp(25) = 7.2e10; the huge dual clip does not bind
    assert loss.item() == pytest.approx(485165195.4097903, rel=1e-6)
    assert metrics["actor/ppo_kl"] == pytest.approx(-20.0)  # from the clamped log-ratio, as verl
    loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad.item() == 0.0


def test_vanilla_ppo_kl_counts_a_clamped_token_as_20():
    old = T([[-1.0, -1.0]])
    logp = T([[-31.0, 0.0]])  # log-ratios -30 (clamped to -20) and 1
    _, metrics = get_policy_loss("vanilla")(logp, old, T([[1.0, 1.0]]), T([[1.0, 1.0]]))
    # mean of the negated clamped log-ratios: (20 - 1) / 2; unclamped it would be (30 - 1) / 2
    assert metrics["actor/ppo_kl"] == pytest.approx(9.5)


def test_vanilla_rejects_dual_clip_at_or_below_one():
    logp, old = _logps(RATIOS)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        get_policy_loss("vanilla")(logp, old, ADV, PG_MASK, clip_ratio_c=1.0)


def test_gspo_sequence_ratio_and_gradient():
    old = torch.zeros(2, 3)
    # row 0: log ratios 0.1, 0.3 (+ a padded 50) -> mean 0.2, r = 1.2214 > 1.2; row 1: -0.3, 0, 0 -> mean -0.1
    logp = T([[0.1, 0.3, 50.0], [-0.3, 0.0, 0.0]], requires_grad=True)
    adv = T([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    mask = T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    loss, metrics = get_policy_loss("gspo")(logp, old, adv, mask, loss_agg_mode="seq-mean-token-mean")
    # row 0: A=1: max(-1.2214, -1.2) = -1.2 (clipped); row 1: A=-2: 2 * exp(-0.1) = 1.809675 (inside the clip)
    # seq-mean-token-mean: (-1.2 + 1.809675) / 2
    close(loss, 0.30483741803595954)
    # the configured mode is honoured (verl): token-mean weighs the 5 tokens alike
    token_mean, token_metrics = get_policy_loss("gspo")(
        logp.detach(), old, adv, mask, loss_agg_mode="token-mean"
    )
    close(token_mean, (-1.2 * 2 + 2 * math.exp(-0.1) * 3) / 5)
    assert metrics["actor/pg_loss"] == pytest.approx(0.30483741803595954, abs=1e-6)
    assert token_metrics["actor/pg_loss"] == pytest.approx((-2.4 + 6 * math.exp(-0.1)) / 5, abs=1e-6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 5)
    assert metrics["actor/pg_clipfrac_lower"] == 0.0
    assert metrics["actor/ppo_kl"] == pytest.approx(-(0.1 + 0.3 - 0.3) / 5, abs=1e-6)
    loss.backward()
    # each row-1 token: d/dlogp_t of (1/2)(1/3)(-A) r_seq = (1/6) * 2 * exp(-0.1) = 0.301612
    # row 0 is clipped -> 0
    g = 0.30161247267865315
    close(logp.grad, [[0.0, 0.0, 0.0], [g, g, g]])


def test_gspo_clamps_the_sequence_log_ratio_above_at_10():
    old = T([[-20.0, -20.0]])
    logp = T([[-5.0, -5.0]])  # sequence log-ratio 15
    loss, metrics = get_policy_loss("gspo")(logp, old, T([[-1.0, -1.0]]), T([[1.0, 1.0]]))
    # A=-1: max(r, clip(r)) = r with r = exp(10) (verl's bound), not exp(15) = 3.3e6
    close(loss, math.exp(10.0))
    assert metrics["actor/ppo_kl"] == pytest.approx(-15.0)  # verl reports GSPO's unclamped log-ratio


def test_gspo_does_not_clamp_the_sequence_log_ratio_below():
    old = T([[0.0, 0.0]])
    logp = T([[-25.0, -25.0]])  # sequence log-ratio -25, past the per-token -20 of vanilla
    loss, _ = get_policy_loss("gspo")(logp, old, T([[1.0, 1.0]]), T([[1.0, 1.0]]))
    # A=1: max(-r, -0.8) = -r with r = exp(-25) (no lower clamp in verl), not exp(-20) = 2.1e-9
    assert loss.item() == pytest.approx(-math.exp(-25.0), rel=1e-5)


def test_gpg_policy_loss():
    logp = T([[-1.0, -2.0], [-0.5, -9.0]], requires_grad=True)
    adv = T([[1.0, 1.0], [-2.0, 5.0]])
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    loss, metrics = get_policy_loss("gpg")(logp, logp.detach(), adv, mask)
    # -logp * A = 1, 2, -1 -> token mean 2/3
    close(loss, 2 / 3)
    assert metrics["actor/pg_clipfrac"] == 0.0 and metrics["actor/ppo_kl"] == 0.0
    loss.backward()
    close(logp.grad, [[-1 / 3, -1 / 3], [2 / 3, 0.0]])


def test_policy_losses_share_one_signature_and_unknown_names_list_valid_ones():
    logp, old = _logps(RATIOS)
    kwargs = dict(
        loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
        global_tokens=None, global_seqs=None, norm_len=None,
    )
    for name in POLICY_LOSSES.names():
        loss, metrics = get_policy_loss(name)(logp, old, ADV, PG_MASK, **kwargs)
        assert loss.dim() == 0
        expected = {"actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"}
        assert expected <= set(metrics)
    with pytest.raises(ValueError) as err:
        get_policy_loss("ppo")
    assert "gpg, gspo, vanilla" in str(err.value)


# --- value loss ------------------------------------------------------------------------------------


def test_value_loss_clip():
    values = T([[1.0, 1.0, 0.2, 4.0]], requires_grad=True)
    old = T([[0.0, 0.0, 0.0, 0.0]])
    returns = T([[2.0, 0.0, 0.2, 0.0]])
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    loss, metrics = value_loss(values, old, returns, mask, cliprange_value=0.5)
    # tok 1: (1-2)^2 = 1 vs (0.5-2)^2 = 2.25 -> 2.25 (clipped); tok 2: 1 vs 0.25 -> 1; tok 3: 0
    close(loss, 0.5 * (2.25 + 1.0 + 0.0) / 3)
    assert metrics["critic/vf_loss"] == pytest.approx(0.5 * 3.25 / 3, abs=1e-6)
    assert metrics["critic/vf_clipfrac"] == pytest.approx(1 / 3)
    assert metrics["critic/vpred_mean"] == pytest.approx(2.2 / 3, abs=1e-6)
    loss.backward()
    # tok 1 takes the clipped branch (no gradient); tok 2: 0.5 * 2 * (1 - 0) / 3
    close(values.grad, [[0.0, 1 / 3, 0.0, 0.0]])


def test_value_loss_global_tokens():
    values = T([[1.0, 3.0]])
    loss, metrics = value_loss(values, values, torch.zeros(1, 2), torch.ones(1, 2), global_tokens=4)
    close(loss, 0.5 * (1 + 9) / 4)
    assert metrics["critic/vf_loss"] == pytest.approx(1.25)  # the share: 2 of the 4 global tokens
