"""One rank and two ranks take the same steps: batch-wide statistics really span the world.

``python -m spmdrl.train`` alone and under torchrun with 2 ranks, on the same
global batch, for the estimators whose statistics are batch-wide: PPO (GAE
advantages whitened over the batch, KL penalty in the reward driven by the
adaptive controller) and REINFORCE++ (returns whitened over the batch, the
same controller). Rollouts are greedy with ``ignore_eos``, so both runs draw
the same responses of equal length, and per-micro-batch metric means equal
the global ones. Had any of these statistics been computed per rank, the
advantages, the KL coefficient and hence the parameters would differ.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TINY
from shared_runs import declare, prepare

pytestmark = pytest.mark.e2e

STEPS = 3
COMMON = [
    *TINY, "--trainer.total_steps", str(STEPS), "--data.train_batch_size", "8",
    "--actor.ppo_mini_batch_size", "8",
    "--critic.ppo_mini_batch_size", "8", "--rollout.n", "2", "--rollout.temperature", "0",
    "--rollout.ignore_eos", "true", "--algorithm.use_kl_in_reward", "true", "--algorithm.kl_penalty", "kl",
    "--algorithm.kl_ctrl.type", "adaptive", "--algorithm.kl_ctrl.kl_coef", "0.05",
    "--algorithm.kl_ctrl.target_kl", "0.001", "--algorithm.kl_ctrl.horizon", "64",
    "--actor.param_dtype", "float32", "--rollout.dtype", "float32", "--model.fused_kernels", "off",
    "--trainer.save_freq", str(STEPS), "--trainer.export_hf_on_save", "true",
]
# Each must match between the runs (a per-rank statistic would move all of them).
COMPARED = ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/reward_kl_penalty",
            "actor/reward_kl_penalty_coeff", "response_length/mean")


@prepare
def _reward(base) -> None:
    # The random model's greedy responses are alike and score 0 on the task: a reward that varies
    # with the prompt (its answer) and the response text instead.
    (base / "rank_parity").mkdir(exist_ok=True)
    (base / "rank_parity" / "reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return sum(map(ord, str(ground_truth) + solution_str)) % 7 / 7\n")


for _config in ("ppo", "reinforce_pp"):
    for _n in (1, 2):
        _balance = ["--trainer.balance_batch", "true"] if _config == "reinforce_pp" and _n == 2 else []
        declare(f"rank_parity/{_config}{_n}", [
            "--config", f"configs/{_config}.yaml", *COMMON, "--reward.function",
            "{base}/rank_parity/reward.py:compute_score", "--trainer.output_dir",
            f"{{base}}/rank_parity/{_config}{_n}", *_balance], nproc=_n)


def _params(out) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "checkpoints" / f"global_step_{STEPS}" / "hf" / "model.safetensors"))


@pytest.mark.parametrize("config", ["ppo", "reinforce_pp"])
def test_one_and_two_ranks_agree(config, shared, spmdrl_cache, monkeypatch):
    outs = {n: shared.path(f"rank_parity/{config}{n}") for n in (1, 2)}
    balance = config == "reinforce_pp"
    one, two = (shared.rows(f"rank_parity/{config}{n}") for n in (1, 2))
    assert len(one) == len(two) == STEPS
    if balance:
        assert all(m["perf/balance_after"] <= m["perf/balance_before"] for m in two)
    keys = COMPARED + (("critic/vf_loss",) if config == "ppo" else ())
    for a, b in zip(one, two):
        for key in keys:
            assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-6), (a["step"], key, a[key], b[key])
    # The controller moved (by the number of responses, as verl), and identically in both runs.
    assert one[-1]["actor/reward_kl_penalty_coeff"] != 0.05
    # Parameters: the runs' difference is float noise next to what training moved (measured 7e-5 of it;
    # Adam magnifies reduction-order noise in near-zero gradients, so elementwise bounds would be loose).
    from safetensors.torch import load_file

    from spmdrl.builtin.models import resolve_builtin_model

    monkeypatch.setenv("SPMDRL_CACHE", spmdrl_cache)
    p0 = load_file(str(resolve_builtin_model("builtin:tiny")) + "/model.safetensors")
    p1, p2 = _params(outs[1]), _params(outs[2])
    assert sorted(p1) == sorted(p2)
    moved = sum(float((p1[k] - p0[k]).float().norm() ** 2) for k in p1) ** 0.5
    apart = sum(float((p1[k] - p2[k]).float().norm() ** 2) for k in p1) ** 0.5
    assert moved > 1.0 and apart < 1e-3 * moved, (apart, moved)
