"""The sbatch scripts and the multi-node launcher for real: a Slurm cluster of two nodes on this machine
(tests/e2e/slurm_cluster.py: munged, slurmctld and a slurmd per node, each node a network namespace).

Every job is submitted as a user submits it (``sbatch [options] slurm/grpo.sbatch --key value ...`` from the
repository root) with ``PYTHON`` naming the interpreter and nothing of it on ``PATH``, and its metrics are
compared, float32 and bitwise but for wall time and memory, with a plain torchrun run of the same arguments
in the shared jobs (tests/e2e/shared_runs.py):

- grpo.sbatch and ppo.sbatch on one node, 2 ranks: equal to the plain run, the promised log lines written, no
  warning of srun's;
- a trainer rank killed by its process id: torchrun (MAX_RESTARTS=1) restarts the ranks, which resume from the
  last checkpoint; then the time limit's signal (``scancel --signal=USR1 --batch``, what ``--signal=B:USR1@N``
  sends): a checkpoint, ``scontrol requeue``, Slurm starts the job again, it resumes and finishes: equal to
  the uninterrupted run;
- preemption (``scancel``: SIGTERM to every process of the job): a checkpoint and a clean exit; the same
  command submitted again resumes from it and finishes, equal to the uninterrupted run;
- two nodes, one rank each: ``launch/multinode.sh`` started by hand in both namespaces, and ``sbatch --nodes
  2``: each equal to the plain 2-rank run; split placement across them (training on one node, rollout on
  the other): equal to the plain 2-rank split run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO
from shared_runs import declare
from slurm_cluster import REQUIRE_ENV, SlurmCluster, unavailable

pytestmark = pytest.mark.e2e

STEPS = 8
ARGS = [
    "--trainer.total_steps", str(STEPS), "--trainer.save_freq", "2", "--data.train_batch_size", "4",
    "--rollout.n", "2", "--actor.ppo_mini_batch_size", "4", "--critic.ppo_mini_batch_size", "4",
    "--data.max_response_length", "8", "--model.fused_kernels", "off", "--trainer.progress_bar", "false",
    "--actor.param_dtype", "float32", "--rollout.dtype", "float32",
]
SPLIT = ["--trainer.total_steps", "2", "--rollout.placement", "split", "--rollout.nnodes", "1",
         "--rollout.n_gpus_per_node", "1", "--rollout.max_staleness", "1"]
# Wall time and memory change from run to run (the training ranks' and, under split placement, the rollout
# ranks' "rollout_ranks/timing/..."); everything else must not.
VOLATILE = ("timing/", "memory/", "perf/")

for _config in ("grpo", "ppo"):
    declare(f"slurm/{_config}", ["--config", f"configs/{_config}.yaml", *ARGS, "--trainer.output_dir",
                                 f"{{base}}/slurm/{_config}"])
declare("slurm/split", ["--config", "configs/grpo.yaml", *ARGS, *SPLIT, "--trainer.output_dir",
                        "{base}/slurm/split"])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, shared) -> SlurmCluster:
    """The two-node cluster, started after the shared runs (which build the cached model the jobs load)."""
    reason = unavailable()
    if reason:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{reason}, and {REQUIRE_ENV}=1 says they must run here")
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    cluster.start()
    yield cluster
    cluster.stop()
    # Nothing left behind: no daemon, no namespace (with it the veth pair).
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert all(proc.poll() is not None for proc in cluster.started), "a Slurm daemon still runs"
    assert not any(node.ns in namespaces for node in cluster.nodes), namespaces


@pytest.fixture
def job_env(spmdrl_cache: str) -> dict[str, str]:
    """A job's environment at submission (sbatch exports it): the interpreter by PYTHON alone."""
    return {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "PYTHON": sys.executable, "NPROC_PER_NODE": "2",
            "OMP_NUM_THREADS": "1", "SPMDRL_CACHE": spmdrl_cache, "HF_HUB_OFFLINE": "1"}


def metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if not any(part in k for part in VOLATILE)} for row in rows]


def submit(cluster: SlurmCluster, script: str, out: Path, env: dict[str, str], *sbatch: str,
           args: tuple[str, ...] = tuple(ARGS)) -> tuple[int, Path]:
    """``sbatch [sbatch] slurm/SCRIPT.sbatch ARGS --trainer.output_dir OUT``: the job id and its log."""
    log = out.parent / f"{out.name}.out"
    job = cluster.sbatch(["--gpus-per-node", "0", "--output", str(log), *sbatch, f"slurm/{script}.sbatch",
                          *args, "--trainer.output_dir", str(out)], env=env, cwd=REPO)
    return job, log


def finished(cluster: SlurmCluster, job: int, log: Path, state: str = "COMPLETED") -> str:
    fields = cluster.wait(job)
    text = log.read_text() if log.exists() else "(no log)"
    got = f"job {job}: {fields['JobState']} {fields['ExitCode']}"
    assert fields["JobState"] == state, f"{got}\n{text[-4000:]}"
    return text


def wait_for(path: Path, cluster: SlurmCluster, job: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        state = cluster.job(job)["JobState"]
        assert state in ("PENDING", "RUNNING", "REQUEUED"), f"job {job} is {state} before {path} appeared"
        assert time.monotonic() < deadline, f"{path} did not appear in {timeout:.0f} s"
        time.sleep(0.1)


@pytest.mark.parametrize("config", ["grpo", "ppo"])
def test_sbatch_equals_torchrun(config, cluster, job_env, shared, tmp_path):
    job, log = submit(cluster, config, tmp_path / config, job_env, "--nodes", "1")
    text = finished(cluster, job, log)
    assert metrics(tmp_path / config) == metrics(shared.path(f"slurm/{config}"))
    # The lines the script promises, and nothing of srun's about flags the cluster does not support.
    assert f"spmdrl: job {job} on n1 (restart 0)" in text
    assert "spmdrl: srun step ended with status 0" in text
    assert "srun: " not in text and "cpu binding" not in text


def test_rank_death_then_time_limit_requeue(cluster, job_env, shared, tmp_path):
    out = tmp_path / "run"
    job, log = submit(cluster, "grpo", out, {**job_env, "MAX_RESTARTS": "1"}, "--nodes", "1")
    wait_for(out / "checkpoints" / "global_step_2", cluster, job)
    ranks = cluster.trainers(cluster.nodes[0])
    assert sorted(ranks) == [0, 1], ranks
    os.kill(ranks[1], 9)
    # The restarted ranks resume from step 2; a checkpoint of step 4 is theirs.
    wait_for(out / "checkpoints" / "global_step_4", cluster, job)
    cluster.run(cluster.nodes[0], ["scancel", "--signal=USR1", "--batch", str(job)])
    # A second signal must not cut the save short (torchrun quits at once on a second one): not passed on.
    time.sleep(0.3)
    cluster.run(cluster.nodes[0], ["scancel", "--signal=USR1", "--batch", str(job)])
    # Slurm holds a requeued job for about two minutes (its BeginTime); as an administrator would, the test
    # lets it start at once.
    cluster.wait(job, states=("PENDING",))
    cluster.run(cluster.nodes[0], ["scontrol", "update", f"JobId={job}", "StartTime=now"])
    text = finished(cluster, job, log)
    assert cluster.job(job)["Restarts"] == "1", text[-4000:]
    assert "resumed from" in text and text.count("got SIGUSR1") == 2
    assert f"requeueing job {job}" in text and text.count("asking the trainer to checkpoint") == 1
    assert f"spmdrl: job {job} on n1 (restart 1)" in text
    assert metrics(out) == metrics(shared.path("slurm/grpo"))


def test_preemption_then_resubmission(cluster, job_env, shared, tmp_path):
    out = tmp_path / "run"
    env = job_env
    job, log = submit(cluster, "grpo", out, env, "--nodes", "1")
    wait_for(out / "checkpoints" / "global_step_2", cluster, job)
    cluster.run(cluster.nodes[0], ["scancel", str(job)])
    text = finished(cluster, job, log, state="CANCELLED")
    saved = (out / "checkpoints" / "latest").read_text().strip()
    assert "got SIGTERM" in text and int(saved.rsplit("_", 1)[-1]) < STEPS, text[-4000:]
    assert "stopping after step" in text and "requeueing" not in text
    again, log = submit(cluster, "grpo", out, env, "--nodes", "1")
    text = finished(cluster, again, log)
    assert "resumed from" in text
    assert metrics(out) == metrics(shared.path("slurm/grpo"))


def test_bad_input_fails_the_job(cluster, job_env, tmp_path):
    job, log = submit(cluster, "ppo", tmp_path / "run", job_env, "--nodes", "1", args=("--actor.lr", "fast"))
    text = finished(cluster, job, log, state="FAILED")
    fields = cluster.job(job)
    assert fields["Restarts"] == "0" and fields["ExitCode"] == "2:0" and "requeueing" not in text
    # One line from the launcher's check, before torchrun (whose restarts would repeat it per rank).
    assert text.count('spmdrl.train: error: config key "actor.lr"') == 1 and "Traceback" not in text


def test_two_nodes_by_hand(cluster, job_env, shared, tmp_path):
    out = tmp_path / "run"
    argv = ["bash", "launch/multinode.sh", "--config", "configs/grpo.yaml", *ARGS, "--trainer.output_dir",
            str(out)]
    procs = [cluster.popen(node, argv, log=tmp_path / f"{node.name}.log", cwd=REPO,
                           env={**job_env, "MASTER_ADDR": "n1", "NNODES": "2", "NODE_RANK": str(rank),
                                "NPROC_PER_NODE": "1"})
             for rank, node in enumerate(cluster.nodes)]
    try:
        codes = [proc.wait(timeout=300) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert codes == [0, 0], "".join((tmp_path / f"{n.name}.log").read_text()[-3000:] for n in cluster.nodes)
    assert metrics(out) == metrics(shared.path("slurm/grpo"))


@pytest.mark.parametrize("run", ["grpo", "split"])
def test_two_nodes_under_slurm(run, cluster, job_env, shared, tmp_path):
    args = tuple(ARGS) if run == "grpo" else (*ARGS, *SPLIT)
    job, log = submit(cluster, "grpo", tmp_path / run, {**job_env, "NPROC_PER_NODE": "1"}, "--nodes", "2",
                      args=args)
    text = finished(cluster, job, log)
    # One rank a node: under split placement the training rank's node and the rollout rank's differ.
    assert f"spmdrl: job {job} on n[1-2]" in text
    assert run == "grpo" or ("training only" in text and "rollout only" in text)
    assert metrics(tmp_path / run) == metrics(shared.path(f"slurm/{run}"))
