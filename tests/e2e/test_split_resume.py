"""Split placement's checkpoints end to end (spmdrl/split/): 1 rollout + 1 training rank under torchrun,
off-policy by one update and by two, the tiny GRPO config.

    full       4 steps, checkpoints at 2 and 4                                     (the reference)
    stopped    the same, with a SIGTERM on the training rank at step 1 -> checkpoint at step 2, exit 0;
               batch 3 is in flight then (generated with the weights of update 1), and under staleness 2
               batch 4 too (batch 3 with the initial weights, 4 with update 1's)
    resumed    a copy of ``stopped``'s folder (what the stop left stays for the tests): auto-resume from
               step 2 to 4, the batches in flight from the checkpoint

(in the shared jobs, tests/e2e/shared_runs.py)

The resumed run must equal the uninterrupted one: every metric that is not a time or a size, and the final
parameters, bitwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import read_metrics
from shared_runs import declare

pytestmark = pytest.mark.e2e

ARGS = [
    "--config", "configs/grpo.yaml", "--trainer.total_steps", "4", "--data.train_batch_size", "4",
    "--rollout.n", "2", "--actor.ppo_mini_batch_size", "2", "--data.max_response_length", "8",
    "--trainer.save_freq", "2", "--trainer.progress_bar", "false",
    "--rollout.placement", "split", "--rollout.nnodes", "1", "--rollout.n_gpus_per_node", "1",
    # A constant rate: a resume applies the configured schedule's length (docs/checkpoints.md), so under
    # grpo.yaml's cosine another total_steps would change the rate of the steps both runs take.
    "--actor.lr_scheduler", "constant",
]
VOLATILE = ("timing/", "memory/", "perf/", "rollout_ranks/")


def metrics(out: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in read_metrics(out)]


SIGTERM = {"SPMDRL_FAULT_INJECT_STEP": "1", "SPMDRL_FAULT_INJECT_RANK": "0",  # the training rank
           "SPMDRL_FAULT_INJECT_SIGNAL": "SIGTERM"}
for _s in (1, 2):
    _args, _base = [*ARGS, "--rollout.max_staleness", str(_s)], f"{{base}}/split_resume{_s}"
    declare(f"split_resume{_s}/full", [*_args, "--trainer.output_dir", f"{_base}/full"])
    declare(f"split_resume{_s}/stopped", [*_args, "--trainer.output_dir", f"{_base}/stopped"], env=SIGTERM)
    declare(f"split_resume{_s}/resumed", [*_args, "--trainer.output_dir", f"{_base}/resumed"],
            copy=(f"{_base}/stopped", f"{_base}/resumed"))


# trainer.total_steps changed on resume (from full's step-2 checkpoint, into a folder of its own): more
# under staleness 2 (its held batch 4 is no longer the last) against an uninterrupted run of that many steps.
declare("split_resume2/longer", [*ARGS, "--rollout.max_staleness", "2", "--trainer.total_steps", "6",
                                 "--trainer.resume", "{base}/split_resume2/full/checkpoints/global_step_2",
                                 "--trainer.hang_timeout_s", "60",
                                 "--trainer.output_dir", "{base}/split_resume2/longer"])
declare("split_resume2/full6", [*ARGS, "--rollout.max_staleness", "2", "--trainer.total_steps", "6",
                                "--trainer.output_dir", "{base}/split_resume2/full6"])

# 3 steps (the end moves onto a held batch, or onto the checkpoint's next step at staleness 0, where the
# rollout rank waits for each update and nothing is held) and 5 (past the old end), against the 4-step run's
# rows. A hang fails in a minute (and, late in the job, takes no other run with it).
declare("split_resume0/full", [*ARGS, "--rollout.max_staleness", "0",
                               "--trainer.output_dir", "{base}/split_resume0/full"])
# (staleness, steps) -> late
CHANGED = {(0, 3): False, (0, 5): False, (1, 3): True, (1, 5): False, (2, 3): True}
for (_s, _n), _late in CHANGED.items():
    declare(f"split_resume{_s}/steps{_n}", [
        *ARGS, "--rollout.max_staleness", str(_s), "--trainer.total_steps", str(_n), "--trainer.resume",
        f"{{base}}/split_resume{_s}/full/checkpoints/global_step_2", "--trainer.hang_timeout_s", "60",
        "--trainer.output_dir", f"{{base}}/split_resume{_s}/steps{_n}"], late=_late)

# Placement changed on resume: a split checkpoint with a batch in flight resumed colocated is refused (it
# would skip that batch); a colocated checkpoint resumed split starts the rollout from its data position
# and weights.
COLOCATED = ARGS[:ARGS.index("--rollout.placement")]
declare("split_resume1/as_colocated", [*COLOCATED, "--trainer.resume",
                                       "{base}/split_resume1/full/checkpoints/global_step_2",
                                       "--trainer.output_dir", "{base}/split_resume1/as_colocated"])
# rollout.max_staleness changed with batches in flight: the roles would disagree on the weights of the
# next batches; refused.
declare("split_resume2/staleness1", [*ARGS, "--rollout.max_staleness", "1", "--trainer.resume",
                                     "{base}/split_resume2/full/checkpoints/global_step_2",
                                     "--trainer.hang_timeout_s", "60",
                                     "--trainer.output_dir", "{base}/split_resume2/staleness1"], late=True)
declare("split_resume1/colocated", [*COLOCATED, "--trainer.output_dir", "{base}/split_resume1/colocated"])
declare("split_resume1/from_colocated", [*ARGS, "--rollout.max_staleness", "1", "--trainer.resume",
                                         "{base}/split_resume1/colocated/checkpoints/global_step_2",
                                         "--trainer.output_dir", "{base}/split_resume1/from_colocated"])


@pytest.fixture(scope="module", params=[1, 2], ids=["staleness1", "staleness2"])
def runs(request: pytest.FixtureRequest, shared) -> dict:
    name = f"split_resume{request.param}"
    for run in ("full", "stopped", "resumed"):
        shared.ran(f"{name}/{run}")
    base = shared.path(name)
    stopped = {"steps": [row["step"] for row in metrics(base / "stopped")],
               "checkpoints": sorted(p.name for p in (base / "stopped" / "checkpoints").iterdir())}
    return {"base": base, "stopped": stopped, "staleness": request.param,
            "stopped_stderr": shared.stderr(f"{name}/stopped"),
            "resumed_stdout": shared.stdout(f"{name}/resumed")}


def test_a_sigterm_on_the_training_rank_checkpoints_the_batches_in_flight(runs):
    assert runs["stopped"] == {"steps": [1, 2], "checkpoints": ["global_step_2", "latest"]}
    saved = runs["base"] / "stopped" / "checkpoints" / "global_step_2" / "in_flight"
    held = [part["info"] for part in json.loads((saved / "batch.json").read_text())["batches"]]
    # Staleness 1: batch 3, generated with the weights of update 1 while update 2 ran. Staleness 2: batch 3
    # with the initial weights and batch 4 (the last) with update 1's. The loader past the last one held.
    want = [(3, 1, False)] if runs["staleness"] == 1 else [(3, 0, False), (4, 1, True)]
    assert [(i["step"], i["version"], i["last"]) for i in held] == want
    assert held[-1]["data"]["position"] == 2 + len(want)
    assert all((saved / f"batch{i}.safetensors").stat().st_size > 0 for i in range(len(want)))
    assert "SIGTERM: checkpoint and stop" in runs["stopped_stderr"]


def test_the_resumed_split_run_equals_the_uninterrupted_one(runs):
    from spmdrl.export import read_model_state

    assert "resumed from" in runs["resumed_stdout"]
    full, resumed = metrics(runs["base"] / "full"), metrics(runs["base"] / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    s = runs["staleness"]
    assert [r["async/staleness"] for r in resumed] == [float(min(k - 1, s)) for k in (1, 2, 3, 4)]
    assert resumed == full
    a = read_model_state(runs["base"] / "full" / "checkpoints" / "global_step_4")
    b = read_model_state(runs["base"] / "resumed" / "checkpoints" / "global_step_4")
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_a_resume_with_more_steps_takes_them_all(shared):
    """Staleness 2, 4 steps raised to 6 at the resume: the held batch 4 is not the last any more, so the
    rollout rank goes on to batches 5 and 6, each two updates behind, as in an uninterrupted 6-step run."""
    shared.ran("split_resume2/longer")
    rows = metrics(shared.path("split_resume2/longer"))
    full6 = metrics(shared.path("split_resume2/full6"))
    assert [r["step"] for r in rows] == [3, 4, 5, 6]
    assert [r["async/staleness"] for r in rows] == [2.0] * 4
    assert rows == full6[2:]


@pytest.mark.parametrize(("staleness", "steps"), list(CHANGED), ids=[f"s{s}-{n}steps" for s, n in CHANGED])
def test_a_resume_with_another_total_steps_trains_the_same_steps_up_to_its_end(shared, staleness, steps):
    """4 steps cut to 3 or raised to 5 at staleness 0, 1 and 2: the resumed run trains steps 3 to its end,
    with the uninterrupted 4-step run's rows up to step 4 (the batches held at step 2, and the later ones,
    come from the same weights), and ends without a hang."""
    name = f"split_resume{staleness}/steps{steps}"
    shared.ran(name)
    rows = metrics(shared.path(name))
    full = metrics(shared.path(f"split_resume{staleness}/full"))
    assert [r["step"] for r in rows] == list(range(3, steps + 1))
    assert rows[:2] == full[2:steps]
    assert [r["async/staleness"] for r in rows] == [float(staleness)] * len(rows)


def test_a_split_checkpoint_with_a_batch_in_flight_resumed_colocated_is_refused(shared):
    said = shared.refused("split_resume1/as_colocated")
    assert "split placement run with the batches of steps 3 in flight" in said
    assert "resume it with rollout.placement split" in said and "\n" not in said


def test_a_colocated_checkpoint_resumed_split_goes_on_from_it(shared):
    shared.ran("split_resume1/from_colocated")
    rows = metrics(shared.path("split_resume1/from_colocated"))
    assert [r["step"] for r in rows] == [3, 4]
    # Batch 3 from the checkpoint's weights (update 2), batch 4 from them too: one update behind.
    assert [(r["async/weights_version"], r["async/staleness"]) for r in rows] == [(2.0, 0.0), (2.0, 1.0)]


def test_a_resume_under_another_staleness_with_batches_in_flight_is_refused(shared):
    said = shared.refused("split_resume2/staleness1")
    assert "holds the batches of steps 3, 4 in flight, generated under rollout.max_staleness 2, but this " \
           "run's is 1; resume with rollout.max_staleness 2" in said and "\n" not in said
