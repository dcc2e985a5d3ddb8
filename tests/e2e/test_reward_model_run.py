"""reward_model.enable end to end: 2 steps on 2 ranks under torchrun with the tiny reward model, its score
mixed with the rule score, and validation whose last batch leaves one rank without prompts (the reward
model's forward is collective, so that rank must still take part)."""

from __future__ import annotations

import math

import pytest
from conftest import TINY, read_metrics, train

pytestmark = pytest.mark.e2e


def test_reward_model_and_rule_score_two_ranks(tmp_path, spmdrl_cache) -> None:
    from spmdrl.builtin.tasks import get_task, write_parquet

    # batches of 4 then 1 prompt
    val = write_parquet(get_task("arith")("val", 5, 0), tmp_path / "val.parquet")
    out = tmp_path / "run"
    train([*TINY, "--trainer.total_steps", "2", "--rollout.n", "2", "--reward_model.enable", "true",
           "--reward_model.model.path", "builtin:tiny-rm", "--reward_model.rule_weight", "0.5",
           "--reward_model.micro_batch_size_per_gpu", "3", "--data.val_files", str(val),
           "--data.val_batch_size", "4", "--trainer.test_freq", "2", "--trainer.output_dir", str(out)],
          cache=spmdrl_cache, nproc=2)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        rm, rule = row["reward/rm_score/mean"], row["reward/rule_score/mean"]
        # Equal rows per rank: the mean of rm + 0.5 * rule is the combination of the means.
        assert math.isclose(row["reward/mean"], rm + 0.5 * rule, rel_tol=1e-5, abs_tol=1e-6), row
        assert rm != 0.0  # the random head scores every text differently from 0
    assert "val-core/spmdrl/arith/acc/mean@1" in rows[1]  # the rule ran too, so its acc is the core variable
    assert "val-aux/spmdrl/arith/reward/mean@1" in rows[1]


def test_reward_model_on_split_placement(tmp_path, spmdrl_cache) -> None:
    """Under rollout.placement split the training ranks hold the reward model: the rollout rank sends the
    rule's part of each score, the training ranks add the model's. Staleness 0 on 1 + 1 ranks is the
    colocated run on one rank, every training metric bitwise (float32, one thread); validation (before
    training and at the end, its rows scored by the training rank's model) within float32 rounding (the
    model scores all rows in one call there, batch by batch colocated). On 1 rollout + 2 training ranks
    at staleness 1 each training rank scores its own rows and a share of the validation rows."""
    from spmdrl.builtin.tasks import get_task, write_parquet

    val = write_parquet(get_task("arith")("val", 5, 0), tmp_path / "val.parquet")
    args = [*TINY, "--trainer.total_steps", "2", "--rollout.n", "2", "--reward_model.enable", "true",
            "--reward_model.model.path", "builtin:tiny-rm", "--reward_model.rule_weight", "0.5",
            "--reward_model.micro_batch_size_per_gpu", "3", "--data.val_files", str(val),
            "--data.val_batch_size", "4", "--trainer.test_freq", "2", "--trainer.val_before_train", "true",
            "--actor.param_dtype", "float32", "--rollout.dtype", "float32"]
    split = ["--rollout.placement", "split", "--rollout.nnodes", "1", "--rollout.n_gpus_per_node", "1"]
    runs = {}
    for name, nproc, extra in (("colocated", 1, []), ("split", 2, [*split, "--rollout.max_staleness", "0"]),
                               ("split3", 3, split)):
        out = tmp_path / name
        train([*args, *extra, "--trainer.output_dir", str(out)], cache=spmdrl_cache, nproc=nproc,
              env={"OMP_NUM_THREADS": "1"})
        runs[name] = read_metrics(out)
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


def test_dynamic_sampling_and_remax_ask_the_training_ranks_model_under_split(tmp_path, spmdrl_cache) -> None:
    """DAPO's dynamic sampling keeps groups by their score as they are generated, and ReMax scores a greedy
    baseline there: under split placement the rollout ranks ask the training ranks' reward model for its
    scores (each generation round, each baseline, each validation batch) and send the batch scored whole.
    Staleness 0 on 1 + 1 ranks is the colocated run on one rank, every training metric bitwise (float32,
    one thread: the model scores a round's rows in one call on both); on 1 + 2 at staleness 1 both training
    ranks answer (a share of the rows each) between their updates and the run ends, one update apart; on
    2 + 1 at staleness 0 a SIGTERM at step 1 of 3 checkpoints at step 2 and ends with exit 0, although both
    rollout ranks are asking about batch 3 then (the training rank answers each its rows and drops the
    batch)."""
    from spmdrl.builtin.tasks import get_task, write_parquet

    val = write_parquet(get_task("arith")("val", 4, 0), tmp_path / "val.parquet")
    # The warm-started model answers alike twice often enough that groups are dropped (more rounds).
    args = [*TINY, "--model.path", "builtin:tiny-arith", "--trainer.total_steps", "2", "--rollout.n", "2",
            "--reward_model.enable", "true", "--reward_model.model.path", "builtin:tiny-rm",
            "--reward_model.rule_weight", "0.5", "--algorithm.adv_estimator", "remax",
            "--algorithm.filter_groups.enable", "true",
            "--algorithm.filter_groups.max_num_gen_batches", "3", "--data.val_files", str(val),
            "--data.val_batch_size", "4", "--trainer.test_freq", "2",
            "--actor.param_dtype", "float32", "--rollout.dtype", "float32"]
    split = ["--rollout.placement", "split", "--rollout.nnodes", "1", "--rollout.n_gpus_per_node", "1"]
    two = [*split, "--rollout.n_gpus_per_node", "2"]
    sigterm = {"SPMDRL_FAULT_INJECT_STEP": "1", "SPMDRL_FAULT_INJECT_RANK": "0",
               "SPMDRL_FAULT_INJECT_SIGNAL": "SIGTERM"}
    runs = {}
    s0 = ["--rollout.max_staleness", "0"]
    for name, nproc, extra, env in (("colocated", 1, [], {}), ("split", 2, [*split, *s0], {}),
                                    ("stale", 3, split, {}),
                                    ("stopped", 3, [*two, *s0, "--trainer.total_steps", "3"], sigterm)):
        out = tmp_path / name
        train([*args, *extra, "--trainer.output_dir", str(out)], cache=spmdrl_cache, nproc=nproc,
              env={"OMP_NUM_THREADS": "1", **env})
        runs[name] = read_metrics(out)
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
    assert (tmp_path / "stopped" / "checkpoints" / "global_step_2").is_dir()
