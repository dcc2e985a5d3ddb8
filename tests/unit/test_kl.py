"""KL estimators, '+' straight-through gradients, KL controllers and the in-reward penalty."""

import pytest
import torch

import spmdrl.algos  # noqa: F401  (fills the registries)
from spmdrl.algos.kl import AdaptiveKLController, FixedKLController, apply_kl_penalty, build_kl_controller
from spmdrl.algos.registry import KL_ESTIMATORS, get_kl

T = torch.tensor

LOGP = T([[-1.0, -2.0]])
REF = T([[-1.5, -1.0]])  # logp - ref = 0.5, -1


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, T(expected, dtype=actual.dtype), atol=atol, rtol=0)


@pytest.mark.parametrize(
    "names, expected",
    [
        (("kl", "k1"), [[0.5, -1.0]]),
        (("abs",), [[0.5, 1.0]]),
        (("mse", "k2"), [[0.125, 0.5]]),  # 0.5 * 0.25, 0.5 * 1
        # d = ref - logp = -0.5, 1: exp(-0.5) + 0.5 - 1, exp(1) - 1 - 1
        (("low_var_kl", "k3"), [[0.10653065971263342, 0.7182818284590451]]),
    ],
)
def test_estimator_values_and_aliases(names, expected):
    for name in names:
        close(get_kl(name)(LOGP, REF), expected)


def test_k3_value_clamp_at_10():
    logp = T([[-1.0, -4.0, -1.0, -1.0]])
    ref = T([[4.0, -1.0, -6.0, -31.0]])  # d = 5, 3, -5, -30
    # e^5 - 6 = 142.4 -> 10; e^3 - 4 = 16.09 -> 10; e^-5 + 4 = 4.0067 (inside); e^-20 + 19 (d clamped) -> 10
    close(get_kl("low_var_kl")(logp, ref), [[10.0, 10.0, 4.006737946999086, 10.0]])


def test_k3_log_ratio_clamp_keeps_the_gradient_finite():
    # d = 100: without the +-20 clamp exp(d) is inf in float32, and the value clamp
    # back-propagates 0 * inf = NaN
    logp = T([[-100.0, -1.0]], requires_grad=True)
    ref = T([[0.0, -1.5]])
    kl = get_kl("k3")(logp, ref)
    kl.sum().backward()
    assert kl[0, 0].item() == 10.0
    assert torch.isfinite(logp.grad).all()
    # saturated token: no gradient; d = -0.5: d/dlogp (e^d - d - 1) = -(e^d - 1) = 1 - e^-0.5
    close(logp.grad, [[0.0, 0.3934693402873666]])


@pytest.mark.parametrize("base", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
def test_plus_variants_have_the_value_of_the_base_and_the_gradient_of_k2(base):
    logp = LOGP.clone().requires_grad_(True)
    value = get_kl(base + "+")(logp, REF)
    torch.testing.assert_close(value, get_kl(base)(LOGP, REF))
    value.sum().backward()
    # d/dlogp 0.5 (logp - ref)^2 = logp - ref
    close(logp.grad, [[0.5, -1.0]])


def test_unknown_estimator_lists_valid_ones():
    with pytest.raises(ValueError) as err:
        get_kl("k4")
    msg = str(err.value)
    assert "'k4'" in msg
    for name in ["abs", "k1", "k2", "k3", "kl", "low_var_kl", "low_var_kl+", "mse", "mse+"]:
        assert name in msg
    assert "kl+" in KL_ESTIMATORS and "abs+" in KL_ESTIMATORS


def test_adaptive_controller():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.5, horizon=100)
    ctrl.update(current_kl=1.0, n_steps=10)  # error 1 -> clipped to 0.2: x (1 + 0.2 * 10 / 100) = x 1.02
    assert ctrl.value == pytest.approx(0.102)
    ctrl.update(current_kl=0.4, n_steps=10)  # error -0.2: x 0.98
    assert ctrl.value == pytest.approx(0.09996)
    ctrl.update(current_kl=0.45, n_steps=50)  # error -0.1: x (1 - 0.1 * 0.5) = x 0.95
    assert ctrl.value == pytest.approx(0.094962)
    restored = build_kl_controller("adaptive", kl_coef=0.1, target_kl=0.5, horizon=100)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == pytest.approx(0.094962)


def test_a_resume_applies_a_changed_kl_coef_and_says_so(capsys):
    """A fixed coefficient is configuration, not state: the configured value wins over the checkpoint's. An
    adaptive one continues from the saved value, unless its configured starting value changed."""
    saved = build_kl_controller("fixed", kl_coef=0.001)
    resumed = build_kl_controller("fixed", kl_coef=0.05)
    resumed.load_state_dict(saved.state_dict())
    assert resumed.value == 0.05
    said = capsys.readouterr().out
    assert said == "[checkpoint] algorithm.kl_ctrl.kl_coef: 0.001 in the checkpoint -> 0.05 configured\n"
    same = build_kl_controller("fixed", kl_coef=0.001)
    same.load_state_dict({"value": 0.001})  # a checkpoint from before the type was saved
    assert same.value == 0.001 and capsys.readouterr().out == ""
    adaptive = build_kl_controller("adaptive", kl_coef=0.1, target_kl=0.5, horizon=100)
    adaptive.update(current_kl=1.0, n_steps=10)
    changed = build_kl_controller("adaptive", kl_coef=0.2, target_kl=0.5, horizon=100)
    changed.load_state_dict(adaptive.state_dict())
    assert changed.value == 0.2
    assert "kl_coef: 0.1 in the checkpoint -> 0.2 configured" in capsys.readouterr().out
    from_fixed = build_kl_controller("adaptive", kl_coef=0.1, target_kl=0.5, horizon=100)
    from_fixed.load_state_dict(saved.state_dict())
    assert from_fixed.value == 0.1 and "type: fixed in the checkpoint -> adaptive" in capsys.readouterr().out


def test_adaptive_controller_rejects_bad_settings():
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(0.1, target_kl=0.0, horizon=10)


def test_fixed_controller_and_factory():
    ctrl = build_kl_controller("fixed", kl_coef=0.05, target_kl=0.1, horizon=10)
    assert isinstance(ctrl, FixedKLController)
    ctrl.update(current_kl=100.0, n_steps=1000)
    assert ctrl.value == 0.05
    assert ctrl.state_dict() == {"type": "fixed", "kl_coef": 0.05, "value": 0.05}
    with pytest.raises(ValueError, match="adaptive, fixed"):
        build_kl_controller("pid", kl_coef=0.1, target_kl=0.1, horizon=10)


def test_apply_kl_penalty():
    rewards = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    logp = T([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    ref = T([[-1.5, -1.0, -0.5], [-1.0, -1.0, -1.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    out, metrics = apply_kl_penalty(rewards, logp, ref, mask, kl_coef=0.1, kl_penalty="kl")
    # k1 = 0.5, 0, -0.5 | -1, -1, (padding: 0)
    close(out, [[-0.05, 0.0, 1.05], [0.1, 2.1, 0.0]])
    # per-response token means 0 and -1 -> batch mean -0.5
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(-0.5)
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)
