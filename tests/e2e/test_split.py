"""Split placement end to end (spmdrl/split/): rollout ranks and training ranks, one program.

- max_staleness 0 (the rollout waits for each update) on 1 rollout + 1 training rank is the colocated run
  on 1 rank: the same samples (keyed by prompt, not rank) and the same updates, float32, every metric,
  validation included (sampled, before training and every 2 steps: the rollout rank validates the
  weights the training rank sends with the request), and the same generation dumps; trainer.val_only
  validates alike.
- max_staleness 1 and 2 on 1 rollout + 1 training rank train on the batches a scripted stale run on one
  process produces (stale_driver.py: step k generated with the weights of update k-1-s), every metric
  equal.
- max_staleness 1 on 1 rollout + 2 training ranks, with DAPO's dynamic sampling, takes its steps one
  update apart: batch k+1 is generated with the weights of update k-1; validating after update 2 holds
  batch 3 (the last) while the rollout rank validates, and the final weights are validated too.

Every run is in the shared jobs (tests/e2e/shared_runs.py).
"""

from __future__ import annotations

import pytest
from conftest import TINY
from shared_runs import declare

pytestmark = pytest.mark.e2e

FLOAT32 = ["--actor.param_dtype", "float32", "--rollout.dtype", "float32"]
SHORT = [*TINY, "--trainer.total_steps", "3", "--trainer.val_before_train", "false", "--trainer.test_freq",
         "-1", "--data.train_batch_size", "8", "--actor.ppo_mini_batch_size", "4", "--rollout.n", "4"]
SPLIT = ["--rollout.placement", "split", "--rollout.nnodes", "1", "--rollout.n_gpus_per_node", "1"]
# What the training ranks learn from the batch, and what the rollout ranks report of it.
COMPARED = ["reward/mean", "response_length/mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy",
            "actor/grad_norm"]
VAL = ["--trainer.val_before_train", "true", "--trainer.test_freq", "2", "--rollout.val_kwargs.n", "2",
       "--rollout.val_kwargs.do_sample", "true", "--rollout.val_kwargs.temperature", "1.0"]
VAL_REWARD = "val-aux/spmdrl/arith/reward/mean@2"
STALE = {s: ["--config", "configs/grpo.yaml", *SHORT, "--trainer.total_steps", str(4 + s), *FLOAT32,
             "--rollout.max_staleness", str(s)] for s in (1, 2)}

# The runs, in the shared jobs (tests/e2e/shared_runs.py: one thread a rank, so that the matmuls round alike
# on one rank and two).
PLACED = {"colocated": (1, []), "split": (2, SPLIT)}
for _name, (_nproc, _placed) in PLACED.items():
    _s0 = ["--rollout.max_staleness", "0"] if _placed else []
    declare(f"split/{_name}", ["--config", "configs/grpo.yaml", *SHORT, *FLOAT32, *VAL, *_placed, *_s0,
                               "--trainer.output_dir", f"{{base}}/split/{_name}",
                               "--trainer.rollout_data_dir", "generations"], nproc=_nproc)
    declare(f"split/val_only_{_name}", ["--config", "configs/grpo.yaml", *SHORT, *FLOAT32, *VAL,
                                        "--trainer.val_only", "true", *_placed,
                                        "--trainer.output_dir", f"{{base}}/split/val_only_{_name}"],
            nproc=_nproc)
declare("split/dapo3", ["--config", "configs/dapo.yaml", *SHORT, *SPLIT, "--trainer.test_freq", "2",
                        "--trainer.output_dir", "{base}/split/dapo3"], nproc=3)
for _s in (1, 2):
    declare(f"split/stale{_s}", [*STALE[_s], *SPLIT, "--trainer.test_freq", "2", "--trainer.output_dir",
                                 f"{{base}}/split/stale{_s}"])
    declare(f"split/scripted{_s}", [*STALE[_s], "--trainer.output_dir", f"{{base}}/split/scripted{_s}"],
            nproc=1, stale=True)


def test_split_without_staleness_equals_the_colocated_run(shared):
    runs = {name: shared.rows(f"split/{name}") for name in ("colocated", "split")}
    # verl's generation dump (written by the rollout rank under split): the same lines.
    for step in (1, 2, 3):
        dumped = [shared.path(f"split/{name}/generations/{step}.jsonl").read_text() for name in runs]
        assert dumped[0] == dumped[1] and dumped[0].count("\n") == 8 * 4
    # Validation before training (step 0), after update 2 and after the last one.
    validated = [(r["step"], VAL_REWARD in r) for r in runs["split"]]
    assert validated == [(0, True), (1, False), (2, True), (3, True)]
    assert [r["step"] for r in runs["colocated"]] == [0, 1, 2, 3]
    assert runs["split"][0] == runs["colocated"][0]
    for a, b in zip(runs["colocated"][1:], runs["split"][1:]):
        for key in COMPARED + ([VAL_REWARD] if VAL_REWARD in a else []):
            assert b[key] == a[key], (a["step"], key)
        assert b["async/staleness"] == 0.0
        assert b["rollout_ranks/timing/rollout"] > 0 and "timing/wait_rollout" in b


def test_validation_alone_on_split_placement(shared):
    """trainer.val_only: the rollout rank validates the initial weights and both roles end; the metrics
    are the colocated run's."""
    runs = {name: shared.rows(f"split/val_only_{name}") for name in ("colocated", "split")}
    assert [r["step"] for r in runs["split"]] == [0] and VAL_REWARD in runs["split"][0]
    assert runs["split"] == runs["colocated"]


def test_one_step_off_policy_on_one_rollout_and_two_training_ranks(shared):
    rows = shared.rows("split/dapo3")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [any(k.startswith("val-core/") for k in r) for r in rows] == [False, True, True]
    # Batch 1 and 2 come from the initial weights, batch 3 from update 1: one update old from step 2 on.
    assert [r["async/weights_version"] for r in rows] == [0.0, 0.0, 1.0]
    assert [r["async/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    for r in rows:
        assert r["dapo/num_gen_batches"] >= 1 and r["batch/responses"] > 0
        assert r["timing/wait_rollout"] >= 0 and r["rollout_ranks/timing/rollout"] > 0
        # The ratio is taken against the rollout's log-probs (bypass): ppo_kl measures the gap to them.
        assert abs(r["actor/ppo_kl"]) < 1.0
    assert "timing/weight_send" in rows[1] and "rollout_ranks/timing/wait_weights" in rows[2]


@pytest.mark.parametrize("staleness", [1, 2])
def test_off_policy_trains_on_what_a_scripted_stale_run_produces(staleness, shared):
    """The split run also validates every 2 steps (its training is the same with or without: validation
    samples on a stream of its own): the weights of update 2 go out with the request, ahead of the rollout's
    batches 3 .. 2 + staleness, which the training rank holds meanwhile; update 4's go out as usual."""
    steps = 4 + staleness
    split, scripted = shared.rows(f"split/stale{staleness}"), shared.scripted(f"split/scripted{staleness}")
    # Batch k is generated with the weights of update k - 1 - staleness (the initial ones before that).
    ks = list(range(1, steps + 1))
    assert [r["async/weights_version"] for r in split] == [max(0, k - 1 - staleness) for k in ks]
    assert [r["step"] for r in scripted] == [r["step"] for r in split] == ks
    assert [k for k, r in zip(ks, split) if any(m.startswith("val-core/") for m in r)] == [2, 4, steps]
    for a, b in zip(scripted, split):
        for key in COMPARED + ["actor/ppo_kl", "batch/responses"]:
            assert b[key] == a[key], (a["step"], key)
