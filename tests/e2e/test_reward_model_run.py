"""reward_model.enable end to end: 2 steps on 2 ranks under torchrun with the tiny reward model, its score
mixed with the rule score, and validation whose last batch leaves one rank without prompts (the reward
model's forward is collective, so that rank must still take part). Every run is in the shared jobs
(tests/e2e/shared_runs.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import TINY
from shared_runs import declare, prepare

pytestmark = pytest.mark.e2e


@prepare
def _val_files(base: Path) -> None:
    from spmdrl.builtin.tasks import get_task, write_parquet

    (base / "rm").mkdir(exist_ok=True)
    for n in (5, 4):  # batches of 4 then 1 prompt; one batch of 4
        write_parquet(get_task("arith")("val", n, 0), base / "rm" / f"val{n}.parquet")


RM = ["--reward_model.enable", "true", "--reward_model.model.path", "builtin:tiny-rm",
      "--reward_model.rule_weight", "0.5"]
declare("rm/two_ranks", [*TINY, "--trainer.total_steps", "2", "--rollout.n", "2", *RM,
                         "--reward_model.micro_batch_size_per_gpu", "3", "--data.val_files",
                         "{base}/rm/val5.parquet", "--data.val_batch_size", "4", "--trainer.test_freq", "2",
                         "--trainer.output_dir", "{base}/rm/two_ranks"])
SPLIT = ["--rollout.placement", "split", "--rollout.nnodes", "1", "--rollout.n_gpus_per_node", "1"]
S0 = ["--rollout.max_staleness", "0"]
SPLIT_ARGS = [*TINY, "--trainer.total_steps", "2", "--rollout.n", "2", *RM,
              "--reward_model.micro_batch_size_per_gpu", "3", "--data.val_files", "{base}/rm/val5.parquet",
              "--data.val_batch_size", "4", "--trainer.test_freq", "2", "--trainer.val_before_train", "true",
              "--actor.param_dtype", "float32", "--rollout.dtype", "float32"]
for _name, _nproc, _extra in (("colocated", 1, []), ("split", 2, [*SPLIT, *S0]), ("split3", 3, SPLIT)):
    declare(f"rm/{_name}", [*SPLIT_ARGS, *_extra, "--trainer.output_dir", f"{{base}}/rm/{_name}"],
            nproc=_nproc)
# The warm-started model answers alike twice often enough that groups are dropped (more rounds).
ASK_ARGS = [*TINY, "--model.path", "builtin:tiny-arith", "--trainer.total_steps", "2", "--rollout.n", "2",
            *RM, "--algorithm.adv_estimator", "remax", "--algorithm.filter_groups.enable", "true",
            "--algorithm.filter_groups.max_num_gen_batches", "3",
            "--data.val_files", "{base}/rm/val4.parquet", "--data.val_batch_size", "4",
            "--trainer.test_freq", "2", "--actor.param_dtype", "float32", "--rollout.dtype", "float32"]
SIGTERM = {"SPMDRL_FAULT_INJECT_STEP": "1", "SPMDRL_FAULT_INJECT_RANK": "0",
           "SPMDRL_FAULT_INJECT_SIGNAL": "SIGTERM"}
TWO_ROLLOUT = [*SPLIT, "--rollout.n_gpus_per_node", "2"]
for _name, _nproc, _extra, _env in (
        ("colocated", 1, [], {}), ("split", 2, [*SPLIT, *S0], {}), ("stale", 3, SPLIT, {}),
        ("stopped", 3, [*TWO_ROLLOUT, *S0, "--trainer.total_steps", "3"], SIGTERM)):
    declare(f"rm/ask_{_name}", [*ASK_ARGS, *_extra, "--trainer.output_dir", f"{{base}}/rm/ask_{_name}"],
            nproc=_nproc, env=_env)


def test_reward_model_and_rule_score_two_ranks(shared) -> None:
    rows = shared.rows("rm/two_ranks")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        rm, rule = row["reward/rm_score/mean"], row["reward/rule_score/mean"]
        # Equal rows per rank: the mean of rm + 0.5 * rule is the combination of the means.
        assert math.isclose(row["reward/mean"], rm + 0.5 * rule, rel_tol=1e-5, abs_tol=1e-6), row
        assert rm != 0.0  # the random head scores every text differently from 0
    assert "val-core/spmdrl/arith/acc/mean@1" in rows[1]  # the rule ran too, so its acc is the core variable
    assert "val-aux/spmdrl/arith/reward/mean@1" in rows[1]


def test_reward_model_on_split_placement(shared) -> None:
    """Under rollout.placement split the training ranks hold the reward model: the rollout rank sends the
    rule's part of each score, the training ranks add the model's. Staleness 0 on 1 + 1 ranks is the
    colocated run on one rank, every training metric bitwise (float32, one thread); validation (before
    training and at the end, its rows scored by the training rank's model) within float32 rounding (the
    model scores all rows in one call there, batch by batch colocated). On 1 rollout + 2 training ranks
    at staleness 1 each training rank scores its own rows and a share of the validation rows."""
    runs = {name: shared.rows(f"rm/{name}") for name in ("colocated", "split", "split3")}
    val_key = "val-aux/spmdrl/arith/reward/mean@1"
    for name in runs:
        assert [r["step"] for r in runs[name]] == [0, 1, 2], name
        assert val_key in runs[name][0] and val_key in runs[name][2], name
        for row in runs[name][1:]:
            rm, rule = row["reward/rm_score/mean"], row["reward/rule_score/mean"]
            assert math.isclose(row["reward/mean"], rm + 0.5 * rule, rel_tol=1e-5, abs_tol=1e-6), (name, row)
            assert rm != 0.0
    for a, b in zip(runs["colocated"], runs["split"]):
        for key in ("reward/mean", "reward/rm_score/mean", "reward/rule_score/mean", "actor/pg_loss",
                    "actor/grad_norm"):
            assert b.get(key) == a.get(key), (a["step"], key)
        if val_key in a:
            assert math.isclose(b[val_key], a[val_key], rel_tol=1e-5, abs_tol=1e-6), a["step"]
    # The initial weights' validation: the same rows, scored by one training rank or shared by two.
    assert math.isclose(runs["split3"][0][val_key], runs["split"][0][val_key], rel_tol=1e-5, abs_tol=1e-6)


def test_dynamic_sampling_and_remax_ask_the_training_ranks_model_under_split(shared) -> None:
    """DAPO's dynamic sampling keeps groups by their score as they are generated, and ReMax scores a greedy
    baseline there: under split placement the rollout ranks ask the training ranks' reward model for its
    scores (each generation round, each baseline, each validation batch) and send the batch scored whole.
    Staleness 0 on 1 + 1 ranks is the colocated run on one rank, every training metric bitwise (float32,
    one thread: the model scores a round's rows in one call on both); on 1 + 2 at staleness 1 both training
    ranks answer (a share of the rows each) between their updates and the run ends, one update apart; on
    2 + 1 at staleness 0 a SIGTERM at step 1 of 3 checkpoints at step 2 and ends with exit 0, although both
    rollout ranks are asking about batch 3 then (the training rank answers each its rows and drops the
    batch)."""
    runs = {name: shared.rows(f"rm/ask_{name}") for name in ("colocated", "split", "stale", "stopped")}
    for a, b in zip(runs["colocated"], runs["split"], strict=True):
        for key in ("reward/mean", "reward/rm_score/mean", "reward/rule_score/mean", "dapo/num_gen_batches",
                    "dapo/dropped_groups", "actor/pg_loss", "actor/grad_norm",
                    "val-aux/spmdrl/arith/reward/mean@1"):
            assert b.get(key) == a.get(key), (a["step"], key, a.get(key), b.get(key))
    assert "val-aux/spmdrl/arith/reward/mean@1" in runs["split"][-1]
    assert max(r["dapo/num_gen_batches"] for r in runs["split"]) >= 2  # rounds asked one after another
    assert [r["async/staleness"] for r in runs["stale"]] == [0.0, 1.0]
    assert all(r["reward/rm_score/mean"] != 0.0 for r in runs["stale"])
    assert [r["step"] for r in runs["stopped"]] == [1, 2]
    assert shared.path("rm/ask_stopped/checkpoints/global_step_2").is_dir()
