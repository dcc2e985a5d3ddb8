"""Interior zeros in the response mask (tool output inside a multi-turn response) are ignored everywhere.

The invariant: a batch whose rows have masked spans in the middle gives, on its valid tokens, exactly what
the same batch gives with those spans cut out (the valid tokens moved left, padding after them), whatever
the masked positions hold; and zero (no gradient) on the masked positions. Checked for every advantage
estimator, every loss aggregation mode, every policy loss, every KL estimator (loss and in-reward penalty),
the entropy bonus, and for where the sequence score is placed.
"""

from __future__ import annotations

import pytest
import torch

import spmdrl.algos  # noqa: F401  (fills the registries)
from spmdrl.algos.kl import apply_kl_penalty
from spmdrl.algos.losses import agg_loss
from spmdrl.algos.registry import (
    ADVANTAGES,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    get_advantage,
    get_kl,
    get_policy_loss,
)
from spmdrl.batch import place_scores

B, T = 6, 12


def _mask() -> torch.Tensor:
    """Rows with tool spans inside (0s between 1s), trailing padding, a row with no span, one all-padding."""
    rows = ["111001110000", "110000011111", "111111100000", "100111000110", "000000000000", "111100001000"]
    return torch.tensor([[int(c) for c in r] for r in rows], dtype=torch.float32)  # [B, T]


def _compact(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The valid entries of each row moved left, zeros after them: [B, T] -> [B, T]."""
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        v = x[i][mask[i].bool()]
        out[i, :len(v)] = v
    return out


def _garbage(x: torch.Tensor, mask: torch.Tensor, seed: int) -> torch.Tensor:
    """``x`` with large finite junk on the masked positions (what tool tokens might hold)."""
    g = torch.Generator().manual_seed(seed)
    return torch.where(mask.bool(), x, 50 * torch.randn(x.shape, generator=g))


def _expand(compact: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_compact`` on the valid positions; zeros elsewhere."""
    out = torch.zeros_like(compact)
    for i in range(mask.shape[0]):
        n = int(mask[i].sum())
        out[i][mask[i].bool()] = compact[i, :n]
    return out


def test_place_scores_on_last_generated_token():
    mask = _mask()
    tr = place_scores(torch.arange(1.0, B + 1), mask)  # [B, T]
    assert tr.nonzero().tolist() == [[0, 7], [1, 11], [2, 6], [3, 10], [5, 8]]
    assert torch.equal(_compact(tr, mask), place_scores(torch.arange(1.0, B + 1), _compact(mask, mask)))


@pytest.mark.parametrize("name", ADVANTAGES.names())
def test_advantages_ignore_interior_masked_tokens(name):
    mask = _mask()
    g = torch.Generator().manual_seed(0)
    # Sequence scores on the last generated token plus small per-token rewards (a KL penalty in the reward).
    rewards = place_scores(torch.randn(B, generator=g), mask) + 0.01 * torch.randn(B, T, generator=g) * mask
    values = torch.randn(B, T, generator=g)
    index = torch.tensor([0, 0, 0, 1, 1, 1])
    kw = dict(values=_garbage(values, mask, 1), baseline=torch.randn(B, generator=g), gamma=0.9, lam=0.8)
    adv, ret = get_advantage(name)(_garbage(rewards, mask, 2), mask, index, **kw)
    cm = _compact(mask, mask)
    kw_c = dict(kw, values=_compact(values, mask))
    adv_c, ret_c = get_advantage(name)(_compact(rewards, mask), cm, index, **kw_c)
    torch.testing.assert_close(adv, _expand(adv_c, mask), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, _expand(ret_c, mask), atol=1e-5, rtol=1e-5)
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES.names())
def test_aggregation_ignores_interior_masked_tokens(mode):
    mask = _mask()
    loss_mat = torch.randn(B, T, generator=torch.Generator().manual_seed(3))
    for counts in ({}, dict(global_tokens=float(mask.sum()) * 2, global_seqs=10.0)):
        got = agg_loss(_garbage(loss_mat, mask, 4), mask, mode, norm_len=T, **counts)
        want = agg_loss(_compact(loss_mat, mask), _compact(mask, mask), mode, norm_len=T, **counts)
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES.names())
@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_policy_losses_ignore_interior_masked_tokens(name, mode):
    mask = _mask()
    g = torch.Generator().manual_seed(5)
    logp, old, adv = (-torch.rand(B, T, generator=g), -torch.rand(B, T, generator=g),
                      torch.randn(B, T, generator=g))
    kw = dict(loss_agg_mode=mode, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, norm_len=T)
    x = _garbage(logp, mask, 6).requires_grad_()
    loss, metrics = get_policy_loss(name)(x, _garbage(old, mask, 7), _garbage(adv, mask, 8), mask, **kw)
    loss.backward()
    assert (x.grad[mask == 0] == 0).all()
    cm = _compact(mask, mask)
    loss_c, metrics_c = get_policy_loss(name)(_compact(logp, mask), _compact(old, mask), _compact(adv, mask),
                                              cm, **kw)
    torch.testing.assert_close(loss, loss_c)
    assert metrics.keys() == metrics_c.keys()
    for k in metrics:
        assert metrics[k] == pytest.approx(metrics_c[k], abs=1e-6), k


@pytest.mark.parametrize("name", KL_ESTIMATORS.names())
def test_kl_loss_and_penalty_ignore_interior_masked_tokens(name):
    mask = _mask()
    g = torch.Generator().manual_seed(9)
    logp, ref = -torch.rand(B, T, generator=g), -torch.rand(B, T, generator=g)
    cm = _compact(mask, mask)
    for mode in LOSS_AGG_MODES.names():
        got = agg_loss(get_kl(name)(_garbage(logp, mask, 1), _garbage(ref, mask, 2)), mask, mode, norm_len=T)
        want = agg_loss(get_kl(name)(_compact(logp, mask), _compact(ref, mask)), cm, mode, norm_len=T)
        torch.testing.assert_close(got, want)
    rewards = place_scores(torch.randn(B, generator=g), mask)
    pen, m = apply_kl_penalty(rewards, _garbage(logp, mask, 3), _garbage(ref, mask, 4), mask, kl_coef=0.1,
                              kl_penalty=name)
    pen_c, m_c = apply_kl_penalty(_compact(rewards, mask), _compact(logp, mask), _compact(ref, mask), cm,
                                  kl_coef=0.1, kl_penalty=name)
    torch.testing.assert_close(pen, _expand(pen_c, mask))
    assert m["actor/reward_kl_penalty"] == pytest.approx(m_c["actor/reward_kl_penalty"])


def test_actor_loss_with_kl_and_entropy_ignores_interior_masked_tokens():
    """The loss the engine calls (objectives.actor_loss_fn): policy loss + KL loss - entropy bonus."""
    from spmdrl.batch import Batch
    from spmdrl.config import Config
    from spmdrl.engines.base import LossScale
    from spmdrl.objectives import actor_loss_fn

    cfg = Config()
    cfg.actor.use_kl_loss, cfg.actor.entropy_coeff, cfg.data.max_response_length = True, 0.01, T
    mask = _mask()
    g = torch.Generator().manual_seed(11)
    fields = {k: -torch.rand(B, T, generator=g) for k in ("logp", "old_logp", "ref_logp", "entropy")}
    fields["advantages"] = torch.randn(B, T, generator=g)
    scale = LossScale(global_tokens=float(mask.sum()), global_seqs=5.0)
    for mode in LOSS_AGG_MODES.names():
        cfg.actor.loss_agg_mode = mode
        fn = actor_loss_fn(cfg)
        results = []
        for m, f in ((mask, lambda x, s: _garbage(x, mask, s)),
                     (_compact(mask, mask), lambda x, s: _compact(x, mask))):
            v = {k: f(x, s) for s, (k, x) in enumerate(fields.items())}
            mb = Batch({"response_mask": m, "old_logp": v["old_logp"], "ref_logp": v["ref_logp"],
                        "advantages": v["advantages"]})
            results.append(fn({"logp": v["logp"], "entropy": v["entropy"]}, mb, scale))
        (loss, metrics), (loss_c, metrics_c) = results
        torch.testing.assert_close(loss, loss_c)
        for k in ("actor/entropy", "actor/kl_loss", "actor/pg_loss"):
            assert metrics[k] == pytest.approx(metrics_c[k], abs=1e-6), (mode, k)
