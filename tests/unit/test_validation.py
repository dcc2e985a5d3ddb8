"""Validation metrics (spmdrl.validation) against hand-computed values."""

from __future__ import annotations

import math

import pytest

from spmdrl.validation import (
    local_sums,
    majority_value,
    name_metrics,
    pass_at_k,
    prompt_metrics,
    sample_sizes,
)


def test_sample_sizes_powers_of_two_then_n() -> None:
    assert sample_sizes(1) == []
    assert sample_sizes(2) == [2]
    assert sample_sizes(4) == [2, 4]
    assert sample_sizes(5) == [2, 4, 5]
    assert sample_sizes(16) == [2, 4, 8, 16]


@pytest.mark.parametrize("n,c,k,expected", [
    (4, 1, 2, 1 - 3 / 6),    # C(3,2)/C(4,2)
    (5, 2, 2, 1 - 3 / 10),   # C(3,2)/C(5,2)
    (4, 1, 1, 0.25),         # pass@1 is the fraction right
    (4, 0, 4, 0.0),
    (4, 2, 4, 1.0),          # fewer wrong than k: a right one is always drawn
    (8, 3, 4, 1 - 5 / 70),   # C(5,4)/C(8,4)
])
def test_pass_at_k_unbiased_estimator(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_rejects_bad_counts() -> None:
    with pytest.raises(ValueError, match="n=4, c=5"):
        pass_at_k(4, 5, 2)


def test_majority_value_first_of_majority_and_ties_to_first_seen() -> None:
    assert majority_value([0.9, 0.8, 0.7], ["A", "B", "A"]) == 0.9
    assert majority_value([0.1, 0.2, 0.3], ["B", "A", "A"]) == 0.2
    assert majority_value([0.1, 0.2], ["B", "A"]) == 0.1  # tie: B was seen first


def test_prompt_metrics_mean_std_pass() -> None:
    m = prompt_metrics([1.0, 0.0, 0.0, 1.0], ["4", "5", "5", "4"])
    assert m["mean@4"] == 0.5
    assert m["std@4"] == 0.5  # population std, as numpy's default and verl
    assert m["pass@2"] == pytest.approx(1 - 1 / 6)  # C(2,2)/C(4,2)
    assert m["pass@4"] == 1.0
    assert sorted(k for k in m if "@4" in k) == [
        "best@4/mean", "best@4/std", "maj@4/mean", "maj@4/std", "mean@4", "pass@4", "std@4", "worst@4/mean",
        "worst@4/std"]


def test_bootstrap_best_worst_match_exact_expectations() -> None:
    # Max of k=2 draws with replacement from {0,1,2,3}: sum v * ((i/4)^2 - ((i-1)/4)^2) = 34/16; min: 14/16.
    m = prompt_metrics([3.0, 0.0, 2.0, 1.0])
    assert m["best@2/mean"] == pytest.approx(34 / 16, abs=0.1)  # 1000 draws: standard error ~0.03
    assert m["worst@2/mean"] == pytest.approx(14 / 16, abs=0.1)
    exact_var = sum(v * v * (2 * v + 1) for v in range(4)) / 16 - (34 / 16) ** 2  # P(max = v) = (2v + 1) / 16
    assert m["best@2/std"] == pytest.approx(math.sqrt(exact_var), abs=0.1)
    # k = n = 4: P(max = v) = ((v + 1) / 4)^4 - (v / 4)^4.
    best4 = sum(v * (((v + 1) / 4) ** 4 - (v / 4) ** 4) for v in range(4))
    assert m["best@4/mean"] == pytest.approx(best4, abs=0.1)
    assert "maj@2/mean" not in m  # no pred: no vote


def test_constant_responses_have_no_spread_and_majority_is_that_value() -> None:
    m = prompt_metrics([0.3] * 4, ["7"] * 4)
    for k in (2, 4):
        assert m[f"best@{k}/mean"] == m[f"worst@{k}/mean"] == m[f"maj@{k}/mean"] == pytest.approx(0.3)
        assert (m[f"best@{k}/std"] == pytest.approx(0.0, abs=1e-12)
                and m[f"maj@{k}/std"] == pytest.approx(0.0, abs=1e-12))


def test_majority_vote_beats_mean_when_the_right_answer_is_most_common() -> None:
    # 3 of 4 responses say "4" (right, 1.0); one says "5" (0.0): maj@4 is right in most bootstrap draws.
    m = prompt_metrics([1.0, 1.0, 0.0, 1.0], ["4", "4", "5", "4"])
    assert m["mean@4"] == 0.75
    assert m["maj@4/mean"] > 0.8


def test_one_response_gives_mean_only() -> None:
    assert prompt_metrics([0.25], ["x"]) == {"mean@1": 0.25}


def _infos():
    # Two prompts of one source (uids 0 and 1), one prompt of another; 4 responses each.
    sources = ["a"] * 8 + ["b"] * 4
    uids = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    infos = {
        "reward": [0.9, 0.1, 0.1, 0.9, 0.5, 0.5, 0.5, 0.5, 1.0, 0.0, 1.0, 0.0],
        "acc": [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, None, None, None, None],  # b's scorer has no acc
        "pred": ["7", "3", "3", "7", "1", "1", "1", "1", "x", "y", "x", "y"],
    }
    return sources, uids, infos


def test_names_as_verl_core_and_aux_means_over_prompts() -> None:
    sources, uids, infos = _infos()
    out = name_metrics(local_sums(sources, uids, infos))
    # Source a's core variable is acc (its scorer returns one); mean over the 2 prompts of the per-prompt
    # means.
    assert out["val-core/a/acc/mean@4"] == pytest.approx((0.5 + 0.0) / 2)
    assert out["val-core/a/acc/pass@4"] == pytest.approx((1.0 + 0.0) / 2)
    assert out["val-aux/a/acc/pass@2"] == pytest.approx((1 - 1 / 6 + 0.0) / 2)
    # and their /std, as verl
    assert "val-core/a/acc/best@4/mean" in out and "val-core/a/acc/maj@4/mean" in out
    assert ("val-core/a/acc/best@4/std" in out and "val-aux/a/acc/std@4" in out
            and "val-aux/a/acc/worst@4/mean" in out)
    assert out["val-aux/a/reward/mean@4"] == pytest.approx((0.5 + 0.5) / 2)
    assert not any(k.startswith("val-aux/a/reward/pass@") for k in out)  # reward is not 0/1 on source a
    # Source b: no acc, so reward is the core variable; its rewards are 0/1, so pass@k is kept.
    assert out["val-core/b/reward/mean@4"] == 0.5
    assert out["val-core/b/reward/pass@4"] == 1.0
    assert not any("/b/acc/" in k for k in out)
    assert all(k.startswith(("val-core/", "val-aux/")) for k in out)


def test_split_over_ranks_by_prompt_gives_the_same_sums() -> None:
    sources, uids, infos = _infos()
    whole = local_sums(sources, uids, infos)
    # Rank 0 holds prompts 0 and 2, rank 1 prompt 1 (all responses of a prompt on one rank).
    parts = [[i for i, u in enumerate(uids) if u in (0, 2)], [i for i, u in enumerate(uids) if u == 1]]
    merged: dict = {}
    for rows in parts:
        part = local_sums([sources[i] for i in rows], [uids[i] for i in rows],
                          {k: [v[i] for i in rows] for k, v in infos.items()})
        for key, (s, c) in part.items():
            acc = merged.setdefault(key, [0.0, 0.0])
            acc[0] += s
            acc[1] += c
    assert merged.keys() == whole.keys()
    for key in whole:
        assert merged[key] == pytest.approx(whole[key]), key


def test_vectorised_majority_equals_the_vote_of_each_draw() -> None:
    import numpy as np

    from spmdrl.validation import bootstrap_majority

    rng = np.random.RandomState(0)
    for n, k in ((4, 2), (5, 5), (8, 4)):
        values = rng.rand(n)
        preds = [str(p) for p in rng.randint(0, 3, size=n)]  # few answers: ties and majorities both occur
        got = bootstrap_majority(values, preds, k, samples=200, seed=7)
        idx = np.random.RandomState(7).randint(0, n, size=(200, k))
        want = [majority_value(values[row], [preds[i] for i in row]) for row in idx]
        assert got.tolist() == want
