"""Advantage estimators and masked statistics against hand-computed values.

Expected numbers are worked out by hand (arithmetic in the comments), never by
re-running the formula under test.
"""

import pytest
import torch

import spmdrl.algos  # noqa: F401  (fills the registries)
from spmdrl.algos.registry import ADVANTAGES, Registry, get_advantage
from spmdrl.algos.utils import masked_mean, masked_sum, masked_var, masked_whiten

T = torch.tensor


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, T(expected, dtype=actual.dtype), atol=atol, rtol=0)


# --- masked statistics ---------------------------------------------------------------------------

X = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
M = T([[1, 1, 0], [1, 0, 0]])  # selects 1, 2, 4


def test_masked_sum_mean_var():
    close(masked_sum(X, M), 7.0)
    close(masked_sum(X, M, dim=-1), [3.0, 4.0])
    close(masked_mean(X, M), 7 / 3)
    close(masked_mean(X, M, dim=-1), [1.5, 4.0])
    # deviations -4/3, -1/3, 5/3 -> squares sum 42/9; unbiased /2 = 7/3, biased /3 = 14/9
    close(masked_var(X, M), 7 / 3)
    close(masked_var(X, M, unbiased=False), 14 / 9)


def test_masked_mean_of_nothing_is_zero_not_nan():
    close(masked_mean(X, torch.zeros_like(M)), 0.0)
    close(masked_mean(X, T([[0, 0, 0], [1, 1, 0]]), dim=-1), [0.0, 4.5])


def test_masked_var_needs_two_elements():
    with pytest.raises(ValueError, match="no element"):
        masked_var(X, torch.zeros_like(M))
    with pytest.raises(ValueError, match="one element"):
        masked_var(X, T([[1, 0, 0], [0, 0, 0]]))
    close(masked_var(X, T([[1, 0, 0], [0, 0, 0]]), unbiased=False), 0.0)


def test_masked_whiten():
    # (x - 7/3) / sqrt(7/3 + 1e-8) at the selected positions
    w = masked_whiten(X, M)
    close(w[M.bool()], [-0.8728715590735306, -0.21821788976838272, 1.0910894488419132])
    w = masked_whiten(X, M, shift_mean=False)
    shifted = [-0.8728715590735306 + 7 / 3, -0.21821788976838272 + 7 / 3, 1.0910894488419132 + 7 / 3]
    close(w[M.bool()], shifted)


def test_per_row_reduction_with_group_is_refused():
    with pytest.raises(ValueError, match="rank-local"):
        masked_mean(X, M, dim=-1, group=object())


# --- registry --------------------------------------------------------------------------------------


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(ValueError) as err:
        get_advantage("ppo2")
    msg = str(err.value)
    assert "'ppo2'" in msg and "algorithm.adv_estimator" in msg
    valid = "gae, gpg, grpo, opo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax, rloo"
    assert msg.endswith(f"valid names: {valid}")


def test_estimator_metadata():
    assert ADVANTAGES.meta("gae") == {"needs_values": True, "needs_baseline": False}
    assert ADVANTAGES.meta("remax") == {"needs_values": False, "needs_baseline": True}
    assert ADVANTAGES.meta("grpo") == {"needs_values": False, "needs_baseline": False}
    with pytest.raises(ValueError, match="valid names"):
        ADVANTAGES.meta("nope")


def test_registry_rejects_unknown_metadata_and_duplicates():
    reg = Registry("thing", "x.y", meta_defaults={"needs_values": False})
    with pytest.raises(ValueError, match="unknown metadata"):
        reg.register("a", needs_valeus=True)
    reg.register("a")(len)
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("a")(len)


def test_every_estimator_takes_the_same_keywords_and_zeroes_padding():
    rewards = T([[0.0, 1.0, 0.0], [0.0, 0.0, 0.5], [2.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    mask = T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    index = T([0, 0, 1, 1])
    kwargs = dict(
        values=T([[0.1, 0.2, 0.3]] * 4), baseline=T([0.5, 0.5, 1.0, 1.0]), gamma=1.0, lam=0.95,
        norm_adv_by_std_in_grpo=True, epsilon=1e-6, group=None,
    )
    for name in ADVANTAGES.names():
        adv, ret = get_advantage(name)(rewards, mask, index, **kwargs)
        assert adv.shape == ret.shape == (4, 3), name
        assert torch.all(adv[mask == 0] == 0) and torch.all(ret[mask == 0] == 0), name
        assert not adv.requires_grad


# --- GAE -------------------------------------------------------------------------------------------


def test_gae_gamma_lam_one_with_trailing_padding():
    rewards = T([[0.0, 0.0, 1.0, 0.0]])
    values = T([[0.5, 0.2, 0.4, 9.0]])  # the padded value 9 must not enter
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    adv, ret = get_advantage("gae")(rewards, mask, T([0]), values=values, gamma=1.0, lam=1.0)
    # t=2: delta = 1 - 0.4 = 0.6; t=1: 0 + 0.4 - 0.2 = 0.2 -> 0.8; t=0: 0.2 - 0.5 = -0.3 -> 0.5
    # returns = adv + values = 1, 1, 1 (the reward-to-go when gamma = lam = 1)
    close(ret, [[1.0, 1.0, 1.0, 0.0]])
    # raw [0.5, 0.8, 0.6] whitened: mean 0.6333, unbiased var 0.023333
    close(adv, [[-0.8728713739001233, 1.091089217375155, -0.21821784347503081, 0.0]])


def test_gae_masked_middle_position_passes_value_and_advantage_through():
    rewards = T([[0.0, 0.0, 0.0, 2.0]])
    values = T([[1.0, 7.0, 2.0, 1.0]])  # value 7 sits on an observation token
    mask = T([[1.0, 0.0, 1.0, 1.0]])
    adv, ret = get_advantage("gae")(rewards, mask, T([0]), values=values, gamma=0.5, lam=0.5)
    # t=3: delta = 2 - 1 = 1 -> A=1
    # t=2: delta = 0 + 0.5*1 - 2 = -1.5 -> A = -1.5 + 0.25*1 = -1.25
    # t=1: masked: next value stays 2, A stays -1.25
    # t=0: delta = 0 + 0.5*2 - 1 = 0 -> A = 0 + 0.25*(-1.25) = -0.3125
    close(ret, [[-0.3125 + 1.0, 0.0, -1.25 + 2.0, 1.0 + 1.0]])
    close(adv, [[-0.11060025228893557, 0.0, -0.9401021444559523, 1.0507023967448879]])


def test_gae_without_values_says_so():
    with pytest.raises(ValueError, match="needs values"):
        get_advantage("gae")(T([[1.0]]), T([[1.0]]), T([0]))


# --- group estimators ------------------------------------------------------------------------------

# Prompt ids need not be contiguous: groups 7 (3 responses), 3 (one response), 42 (two).
INDEX = T([7, 7, 7, 3, 42, 42])
MASK = T([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
# Scores 1, 0, 0 | 0.7 | 2, 2 placed on the last valid token; the 5.0 sits on padding and must be ignored.
REWARDS = T([[0.0, 1.0], [0.0, 0.0], [0.0, 5.0], [0.0, 0.7], [0.5, 1.5], [2.0, 0.0]])


def test_grpo():
    adv, ret = get_advantage("grpo")(REWARDS, MASK, INDEX)
    # group 7: mean 1/3, unbiased std sqrt(1/3); (2/3)/(0.57735+1e-6) and (-1/3)/(0.57735+1e-6)
    # group 3 (alone): mean 0, std 1 -> 0.7 / (1 + 1e-6); group 42: std 0 -> 0 / 1e-6 = 0
    hi, lo = 1.1546985383827155, -0.5773492691913578
    close(adv, [[hi, hi], [lo, lo], [lo, 0.0], [0.6999993, 0.6999993], [0.0, 0.0], [0.0, 0.0]])
    assert torch.equal(adv, ret)


def test_dr_grpo_skips_the_std():
    adv, _ = get_advantage("grpo")(REWARDS, MASK, INDEX, norm_adv_by_std_in_grpo=False)
    close(adv, [[2 / 3, 2 / 3], [-1 / 3, -1 / 3], [-1 / 3, 0.0], [0.7, 0.7], [0.0, 0.0], [0.0, 0.0]])


def test_rloo():
    rewards = REWARDS.clone()
    rewards[5, 0] = 3.0  # group 42 scores 2, 3
    adv, ret = get_advantage("rloo")(rewards, MASK, INDEX)
    # group 7: 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5; group 42: 2 - 3 = -1, 3 - 2 = 1
    # a lone response keeps its score 0.7
    close(adv, [[1.0, 1.0], [-0.5, -0.5], [-0.5, 0.0], [0.7, 0.7], [-1.0, -1.0], [1.0, 0.0]])
    assert torch.equal(adv, ret)


def test_reinforce_plus_plus_ignores_padding_rewards():
    rewards = T([[1.0, 0.0, 2.0, 5.0], [0.0, 3.0, 0.0, 0.0]])
    mask = T([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    adv, ret = get_advantage("reinforce_plus_plus")(rewards, mask, T([0, 1]), gamma=0.5)
    # row 0: the padded 5 is cut off: 2; 0 + 0.5*2 = 1; 1 + 0.5*1 = 1.5. row 1: 3; 0 + 0.5*3 = 1.5
    close(ret, [[1.5, 1.0, 2.0, 0.0], [1.5, 3.0, 0.0, 0.0]])
    # whiten 1.5, 1, 2, 1.5, 3: mean 1.8, unbiased var 2.3/4 = 0.575
    a, b, c, e = -0.39562828059722627, -1.05500874825927, 0.26375218706481746, 1.5825131223889048
    close(adv, [[a, b, c, 0.0], [a, e, 0.0, 0.0]])


def test_reinforce_plus_plus_carries_the_return_across_interior_masked_tokens():
    # A tool output (mask 0) inside the response: the return flows through it, discounted per valid token.
    rewards = T([[0.0, 0.0, 9.0, 0.0, 0.0, 1.0]])  # the 9 sits on a masked token: no reward there
    mask = T([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0]])
    adv, ret = get_advantage("reinforce_plus_plus")(rewards, mask, T([0]), gamma=0.5)
    # t5: 1; t4: 0.5; t3, t2: masked -> 0, carry 0.5; t1: 0.5 * 0.5 = 0.25; t0: 0.125
    # (restarting the return at the masked t3 would give 0, 0 at t0, t1)
    close(ret, [[0.125, 0.25, 0.0, 0.0, 0.5, 1.0]])
    # whiten the 4 valid returns: mean 0.46875, deviations -0.34375, -0.21875, 0.03125, 0.53125,
    # unbiased var 0.44921875 / 3 = 0.14974, std 0.38696; the masked positions stay 0
    a, b, c, d = -0.8883301087334725, -0.5653009782849371, 0.08075728261213387, 1.3728738044062758
    close(adv, [[a, b, 0.0, 0.0, c, d]])


def test_reinforce_plus_plus_baseline():
    rewards = T([[0.0, 3.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
    mask = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    adv, ret = get_advantage("reinforce_plus_plus_baseline")(rewards, mask, T([0, 0, 1]))
    # group 0: scores 3, 1, mean 2 -> 1, -1; lone group 1: baseline 0 -> 5
    # tokens 1, 1, -1, 5, 5, 5 whitened: mean 8/3, unbiased var 35.333/5
    a, b, c = -0.6269623277757934, -1.3793171211067456, 0.877747258886111
    close(adv, [[a, a, 0.0], [b, 0.0, 0.0], [c, c, c]])
    assert torch.equal(adv, ret)


def test_remax():
    rewards = T([[0.0, 1.0, 2.0, 0.0], [1.0, 0.0, 0.0, 4.0]])
    mask = T([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    adv, ret = get_advantage("remax")(rewards, mask, T([0, 1]), baseline=T([2.5, 0.0]))
    # reward-to-go 3, 3, 2 and 1, 0 (the padded 4 is ignored); minus the greedy rewards 2.5 and 0
    close(ret, [[3.0, 3.0, 2.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    close(adv, [[0.5, 0.5, -0.5, 0.0], [1.0, 0.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="baseline"):
        get_advantage("remax")(rewards, mask, T([0, 1]))


def test_gpg():
    rewards = T([[1.0], [0.0], [0.0], [0.0], [3.0]])
    mask = torch.ones(5, 1)
    adv, ret = get_advantage("gpg")(rewards, mask, T([0, 0, 1, 1, 2]))
    # alpha = 5 responses / 2 non-zero = 2.5; group 0: mean 0.5 -> +-0.5*2.5; group 1: 0; lone 3 -> 7.5
    close(adv, [[1.25], [-1.25], [0.0], [0.0], [7.5]])
    assert torch.equal(adv, ret)


def test_gpg_all_zero_scores_do_not_divide_by_zero():
    adv, _ = get_advantage("gpg")(torch.zeros(3, 2), torch.ones(3, 2), T([0, 0, 1]))
    close(adv, [[0.0, 0.0]] * 3)


def test_opo_length_weighted_baseline():
    rewards = T([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 4.0, 0.0]])
    mask = T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    adv, ret = get_advantage("opo")(rewards, mask, T([0, 0, 0, 1]))
    # group 0: scores 1, 0, 1, lengths 2, 3, 1 -> baseline (2 + 0 + 1) / 6 = 0.5; lone group: baseline 0
    close(adv, [[0.5, 0.5, 0.0], [-0.5, -0.5, -0.5], [0.5, 0.0, 0.0], [4.0, 4.0, 0.0]])
    assert torch.equal(adv, ret)
