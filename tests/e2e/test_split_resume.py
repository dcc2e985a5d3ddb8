"""Split placement's checkpoints end to end (spmdrl/split/): 1 rollout + 1 training rank under torchrun,
off-policy by one update and by two, the tiny GRPO config.

    full       4 steps, checkpoints at 2 and 4                                     (the reference)
    stopped    the same, with a SIGTERM on the training rank at step 1 -> checkpoint at step 2, exit 0;
               batch 3 is in flight then (generated with the weights of update 1), and under staleness 2
               batch 4 too (batch 3 with the initial weights, 4 with update 1's)
    resumed    ``stopped``'s folder again: auto-resume from step 2 to 4, the batches in flight from the
               checkpoint

The resumed run must equal the uninterrupted one: every metric that is not a time or a size, and the final
parameters, bitwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import read_metrics, train

pytestmark = pytest.mark.e2e

ARGS = [
    "--config", "configs/grpo.yaml", "--trainer.total_steps", "4", "--data.train_batch_size", "4",
    "--rollout.n", "2", "--actor.ppo_mini_batch_size", "2", "--data.max_response_length", "8",
    "--trainer.save_freq", "2", "--trainer.progress_bar", "false",
    "--rollout.placement", "split", "--rollout.nnodes", "1", "--rollout.n_gpus_per_node", "1",
]
VOLATILE = ("timing/", "memory/", "perf/", "rollout_ranks/")


def metrics(out: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in read_metrics(out)]


@pytest.fixture(scope="module", params=[1, 2], ids=["staleness1", "staleness2"])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, spmdrl_cache: str) -> dict:
    base = tmp_path_factory.mktemp("split_resume")
    procs = {}
    args = [*ARGS, "--rollout.max_staleness", str(request.param)]

    def torchrun(name: str, out: Path, env: dict | None = None) -> None:
        procs[name] = proc = train([*args, "--trainer.output_dir", str(out)], cache=spmdrl_cache, nproc=2,
                                   env=env, check=False)
        (base / f"{name}.log").write_text(proc.stdout + proc.stderr)
        assert proc.returncode == 0, f"{name} run failed:\n{proc.stderr[-4000:]}"

    torchrun("full", base / "full")
    torchrun("stopped", base / "stopped", env={"SPMDRL_FAULT_INJECT_STEP": "1",
                                               "SPMDRL_FAULT_INJECT_RANK": "0",  # the training rank
                                               "SPMDRL_FAULT_INJECT_SIGNAL": "SIGTERM"})
    stopped = {"steps": [row["step"] for row in metrics(base / "stopped")],
               "checkpoints": sorted(p.name for p in (base / "stopped" / "checkpoints").iterdir())}
    torchrun("resumed", base / "stopped")
    return {"base": base, "procs": procs, "stopped": stopped, "staleness": request.param}


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
    assert "SIGTERM: checkpoint and stop" in runs["procs"]["stopped"].stderr


def test_the_resumed_split_run_equals_the_uninterrupted_one(runs):
    from spmdrl.export import read_model_state

    assert "resumed from" in runs["procs"]["resumed"].stdout
    full, resumed = metrics(runs["base"] / "full"), metrics(runs["base"] / "stopped")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    s = runs["staleness"]
    assert [r["async/staleness"] for r in resumed] == [float(min(k - 1, s)) for k in (1, 2, 3, 4)]
    assert resumed == full
    a = read_model_state(runs["base"] / "full" / "checkpoints" / "global_step_4")
    b = read_model_state(runs["base"] / "stopped" / "checkpoints" / "global_step_4")
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
