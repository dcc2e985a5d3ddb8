"""The same run on 1, 2 and 4 ranks draws the same samples and trains the same updates, and a resume on
another world size draws the samples of the uninterrupted run.

Sampling noise is keyed by (seed, step, prompt id, sample, position), never by rank or batch slot
(``spmdrl/rollout/sampling.py``), so in float32 the runs' responses, compared one by one in
``trainer.rollout_data_dir`` (verl's generation dump), agree; what may break the rest is rounding: a
batch of another size runs the same matmuls in another blocking, and a token whose probability sits at
the drawn uniform's edge can flip. A run resumed from the 2-rank run's step-1 checkpoint on 4 ranks
continues with the samples of the uninterrupted 2-rank run. The validation before training, sampled at
temperature 1, scores the same on every world size.

The updates agree too, with several mini-batches and epochs (each global mini-batch holds the same
prompts at any world size: spmdrl/placement.py), with a critic (configs/ppo.yaml) and with DAPO's dynamic
sampling (configs/dapo.yaml: the first kept groups in global prompt order, whatever rank drew them): in
float32, every logged metric but timings and memory within 1e-5 (relative for gradient norms and
other large values), counts included; and so do runs under sequence parallelism (parallel.sp 2), and the
MoE config with routing replay on 1 rank, 2 ranks and 2 ranks under expert parallelism (parallel.ep 2).
The runs are in the shared jobs (tests/e2e/shared_runs.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import TINY, read_metrics
from shared_runs import declare

pytestmark = pytest.mark.e2e

STEPS = 3
COMMON = [
    "--config", "configs/grpo.yaml", *TINY, "--trainer.total_steps", str(STEPS),
    "--data.train_batch_size", "8", "--actor.ppo_epochs", "2",
    "--actor.ppo_mini_batch_size", "4", "--rollout.n", "4", "--data.max_response_length", "16",
    "--actor.param_dtype", "float32", "--rollout.dtype", "float32", "--model.fused_kernels", "off",
    "--trainer.rollout_data_dir", "generations", "--trainer.val_before_train", "true",
    "--rollout.val_kwargs.n", "2", "--rollout.val_kwargs.do_sample", "true",
    "--rollout.val_kwargs.temperature", "1.0",
]
VAL = "val-aux/spmdrl/arith/reward/mean@2"


def _generations(out: Path, step: int) -> dict[tuple[int, int], dict]:
    rows = [json.loads(line) for line in (out / "generations" / f"{step}.jsonl").read_text().splitlines()]
    return {(r["index"], r["sample"]): r for r in rows}


def _same(a: dict, b: dict) -> float:
    """The share of responses (by prompt id and sample) with the same text."""
    assert a.keys() == b.keys()
    return sum(a[k]["output"] == b[k]["output"] for k in a) / len(a)


for _n in (1, 2, 4):
    _save = ["--trainer.save_freq", "1", "--trainer.keep_last", "3"] if _n == 2 else []
    declare(f"world_size/ranks{_n}", [*COMMON, "--trainer.output_dir", f"{{base}}/world_size/ranks{_n}",
                                      *_save], nproc=_n)
# Sequence parallelism (parallel.sp 2: both ranks run every row, each half of its tokens) against 1 rank.
declare("world_size/sp2", [*COMMON, "--parallel.sp", "2", "--trainer.output_dir", "{base}/world_size/sp2"])
# The 2-rank SP 1 run's step-1 checkpoint resumed at SP 2 (DCP reshards FSDP's dp shards to dp x sp ones).
declare("world_size/resumed_sp2", [*COMMON, "--parallel.sp", "2", "--trainer.val_before_train", "false",
                                   "--trainer.resume", "{base}/world_size/ranks2/checkpoints/global_step_1",
                                   "--trainer.output_dir", "{base}/world_size/resumed_sp2"])
declare("world_size/resumed", [*COMMON, "--trainer.output_dir", "{base}/world_size/resumed",
                               "--trainer.resume", "{base}/world_size/ranks2/checkpoints/global_step_1",
                               "--trainer.val_before_train", "false"], nproc=4)


# The shipped configs as they are (several mini-batches; PPO's critic with mini-batches of its own; DAPO's
# rounds), two steps, in float32.
F32 = ["--actor.param_dtype", "float32", "--rollout.dtype", "float32", "--model.fused_kernels", "off",
       "--trainer.total_steps", "2", "--trainer.progress_bar", "false", "--trainer.resume", "off",
       "--trainer.test_freq", "-1"]
for _config in ("ppo", "dapo"):
    for _n in (1, 2, 4):
        declare(f"world_size/{_config}{_n}", ["--config", f"configs/{_config}.yaml", *F32,
                                               "--trainer.output_dir", f"{{base}}/world_size/{_config}{_n}"],
                nproc=_n)
# With the critic, groups balanced over the ranks and token budgets (per rank: an SP group's micro-batch
# takes sp x the budget, each rank 1/sp of it) on every pass.
BUDGETS = ["--trainer.balance_batch", "true", "--actor.use_dynamic_bsz", "true", "--critic.use_dynamic_bsz",
           "true", "--actor.log_prob_use_dynamic_bsz", "true", "--ref.log_prob_use_dynamic_bsz", "true",
           *[f"--{k}_max_token_len_per_gpu={n}" for k, n in (("actor.ppo", 300), ("actor.log_prob", 500),
                                                              ("ref.log_prob", 500), ("critic.ppo", 300),
                                                              ("critic.forward", 500))]]
declare("world_size/ppo_sp2", ["--config", "configs/ppo.yaml", *F32, "--parallel.sp", "2", *BUDGETS,
                               "--trainer.output_dir", "{base}/world_size/ppo_sp2"])
# The MoE config (rollout routing replay, R3) on builtin:tiny-moe: 1 rank, 2 ranks, and 2 ranks splitting each
# layer's experts (parallel.ep 2), with four mini-batches; 8 prompts x 4 samples.
MOE = ["--config", "configs/grpo_moe.yaml", *F32, "--model.path", "builtin:tiny-moe",
       "--data.train_batch_size", "8", "--rollout.n", "4", "--actor.ppo_mini_batch_size", "2",
       "--data.max_response_length", "8"]
for _name, _n, _extra in (("moe1", 1, []), ("moe2", 2, []), ("moe_ep2", 2, ["--parallel.ep", "2"])):
    declare(f"world_size/{_name}", [*MOE, *_extra, "--trainer.output_dir", f"{{base}}/world_size/{_name}"],
            nproc=_n)


def _differences(rows: list[list[dict]], step: int) -> list[str]:
    """The metrics of ``step`` that differ between the runs beyond float32 rounding (1e-5, relative above
    1)."""
    at = [next(r for r in run if r.get("step") == step and "reward/mean" in r) for run in rows]
    keys = set().union(*at) - {"step"}
    out = []
    for k in sorted(keys):
        if k.startswith(("timing/", "memory/", "perf/")):
            continue  # how long and how much, not what was computed
        vals = [m.get(k) for m in at]
        if any(v is None for v in vals) or any(not math.isclose(v, vals[0], rel_tol=1e-5, abs_tol=1e-5)
                                               for v in vals):
            out.append(f"{k}: {vals}")
    return out


@pytest.fixture(scope="module")
def runs(shared) -> dict[str, Path]:
    run = shared.stdout("world_size/resumed") + shared.stderr("world_size/resumed")
    assert "resumed from" in run
    return {name: shared.path(f"world_size/{name}") for name in ("ranks1", "ranks2", "ranks4", "resumed")}


def test_one_two_and_four_ranks_draw_the_same_samples(runs):
    one, two, four = (read_metrics(runs[f"ranks{n}"]) for n in (1, 2, 4))
    # Validation before training: the same weights, the same keyed samples, the same score.
    assert one[0][VAL] == two[0][VAL] == four[0][VAL]
    for step in (1, 2, 3):
        g1, g2, g4 = (_generations(runs[f"ranks{n}"], step) for n in (1, 2, 4))
        assert len(g1) == 32 and _same(g1, g2) >= 0.99 and _same(g1, g4) >= 0.99, step
        if g1 == g2 == g4:  # while the samples agree, so do the rewards
            m = [next(r for r in rows if r.get("step") == step and "reward/mean" in r)
                 for rows in (one, two, four)]
            assert all(math.isclose(x["reward/mean"], m[0]["reward/mean"], abs_tol=1e-6) for x in m)
    # The run learned something from step to step: the samples are not the same every step.
    assert _generations(runs["ranks1"], 1) != _generations(runs["ranks1"], 2)


def test_a_resume_on_another_world_size_draws_the_uninterrupted_samples(runs):
    assert not (runs["resumed"] / "generations" / "1.jsonl").exists()  # it started after step 1
    for step in (2, 3):
        assert _same(_generations(runs["resumed"], step), _generations(runs["ranks2"], step)) >= 0.99, step


def test_the_updates_agree_on_one_two_and_four_ranks_with_several_mini_batches_and_epochs(runs):
    rows = [read_metrics(runs[f"ranks{n}"]) for n in (1, 2, 4)]
    assert rows[0][1]["batch/responses"] == 32  # a count is the batch's, not a rank's share
    assert _differences(rows, 1) == []
    if all(_generations(runs[f"ranks{n}"], 2) == _generations(runs["ranks1"], 2) for n in (2, 4)):
        assert _differences(rows, 2) == []


def test_sequence_parallel_runs_train_as_one_rank_step_for_step(shared, runs):
    """SP 2 on 2 ranks (GRPO, 3 steps; PPO with its critic, balance and token budgets, 2 steps) against the
    1-rank runs: the same samples (keyed by prompt) and every metric within 1e-5."""
    sp, one = read_metrics(shared.path("world_size/sp2")), read_metrics(runs["ranks1"])
    for step in (1, 2, 3):
        assert _generations(shared.path("world_size/sp2"), step) == _generations(runs["ranks1"], step), step
        assert _differences([one, sp], step) == [], step
    ppo = [read_metrics(shared.path(f"world_size/{name}")) for name in ("ppo1", "ppo_sp2")]
    assert _differences(ppo, 1) == [] and _differences(ppo, 2) == []


def test_an_sp_1_checkpoint_resumes_at_sp_2(shared, runs):
    resumed = shared.path("world_size/resumed_sp2")
    assert "resumed from" in shared.stdout("world_size/resumed_sp2")
    for step in (2, 3):
        assert _generations(resumed, step) == _generations(runs["ranks2"], step), step
        assert _differences([read_metrics(runs["ranks2"]), read_metrics(resumed)], step) == [], step


@pytest.mark.parametrize("config", ["ppo", "dapo"])
def test_the_shipped_critic_and_dapo_configs_train_the_same_on_one_two_and_four_ranks(shared, config):
    rows = [read_metrics(shared.path(f"world_size/{config}{n}")) for n in (1, 2, 4)]
    assert _differences(rows, 1) == []
    if config == "dapo":  # the same groups kept, however many rounds each rank needed
        assert rows[0][0]["dapo/kept_groups"] >= 16 and rows[0][0]["batch/responses"] == 16 * 8


def test_an_moe_run_with_replay_trains_the_same_on_one_and_two_ranks_and_with_expert_parallelism(shared):
    rows = [read_metrics(shared.path(f"world_size/{name}")) for name in ("moe1", "moe2", "moe_ep2")]
    first = next(r for r in rows[0] if "reward/mean" in r)
    # The rollout's experts that the router still picks over the step's 4 optimizer steps: all of them before
    # the first, fewer as the router moves (R3 replays them all the same).
    assert 0.5 < first["actor/moe/router_agreement"] < 1
    assert _differences(rows, 1) == []
