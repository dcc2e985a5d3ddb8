"""Launchers: Slurm hostlists, rendered torchrun commands, the CLI and the shell scripts.

Everything runs without Slurm or a GPU: Slurm is a dict of environment
variables (an 8-GPU node's argv is what a CPU cluster cannot show). The sbatch
scripts run under a real Slurm in tests/e2e/test_slurm.py.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from spmdrl.launch import (
    LaunchError,
    expand_hostlist,
    local_torchrun_command,
    main,
    multinode_torchrun_command,
    slurm_nproc_per_node,
    slurm_torchrun_command,
)

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
PREFIX = shlex.join(TORCHRUN)

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*REPO.glob("launch/*.sh"), *REPO.glob("slurm/*.sbatch")])
SLURM_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def _clean_env(**extra: str) -> dict[str, str]:
    """The current environment without anything a launcher reads, plus ``extra``."""
    launcher_vars = {
        "MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "NPROC", "NPROC_PER_NODE", "RDZV_ID",
        "MAX_RESTARTS", "SPMDRL_DRY_RUN", "SPMDRL_REQUEUE",
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM") and k not in launcher_vars}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def _slurm_env(**extra: str) -> dict[str, str]:
    """What srun shows a task of a 2-node x 4-GPU job (node gpu02, the second one)."""
    env = {
        "SLURM_JOB_ID": "123456",
        "SLURM_JOB_NODELIST": "gpu[01-02]",
        "SLURM_NNODES": "2",
        "SLURM_GPUS_ON_NODE": "4",
        "SLURM_NTASKS_PER_NODE": "1",
    }
    env.update(extra)
    return env


# Hostlists ------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, hosts",
    [
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
        ("a-b[001-002]", ["a-b001", "a-b002"]),
        ("login1", ["login1"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("x.cluster,y[3],z[0-1].ib", ["x.cluster", "y3", "z0.ib", "z1.ib"]),
    ],
)
def test_expand_hostlist(spec: str, hosts: list[str]) -> None:
    assert expand_hostlist(spec) == hosts


@pytest.mark.parametrize(
    "spec, message",
    [
        ("", "empty"),
        ("gpu[01-03", "unbalanced '['"),
        ("gpu01-03]", "unbalanced ']'"),
        ("gpu[[1]]", "nested"),
        ("gpu[3-1]", "descending"),
        ("gpu[a-b]", "bad range"),
        ("gpu1,,gpu2", "empty host name"),
        ("gpu 1", "invalid character"),
    ],
)
def test_expand_hostlist_rejects(spec: str, message: str) -> None:
    with pytest.raises(LaunchError, match=re.escape(message)):
        expand_hostlist(spec)


# Slurm command --------------------------------------------------------------


def test_slurm_command_two_nodes_four_gpus() -> None:
    cmd = slurm_torchrun_command(_slurm_env(), ["--config", "configs/grpo.yaml"])
    assert cmd == [
        *TORCHRUN,
        "--nnodes", "2",
        "--nproc-per-node", "4",
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "gpu01:23456",  # 20000 + 123456 % 20000
        "--rdzv-id", "123456",
        "--max-restarts", "3",
        "--signals-to-handle", SLURM_SIGNALS,
        "--shutdown-timeout", "100",
        "-m", "spmdrl.train",
        "--config", "configs/grpo.yaml",
    ]


def test_slurm_command_cpu_only_uses_tasks_per_node() -> None:
    env = {
        "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "cpu[1-3]",
        "SLURM_NNODES": "3", "SLURM_NTASKS_PER_NODE": "2",
    }
    cmd = slurm_torchrun_command(env, ["--config", "x.yaml"], max_restarts=0)
    assert cmd[:15] == [
        *TORCHRUN, "--nnodes", "3", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "cpu1:20007", "--rdzv-id", "7", "--max-restarts", "0",
    ]
    assert cmd[-4:] == ["-m", "spmdrl.train", "--config", "x.yaml"]


def test_slurm_overrides_and_store_host() -> None:
    env = _slurm_env(MASTER_PORT="29999", MAX_RESTARTS="1", SLURMD_NODENAME="gpu01")
    cmd = slurm_torchrun_command(env, [], nproc_per_node=2, shutdown_timeout=50)
    joined = " ".join(cmd)
    assert "--rdzv-endpoint gpu01:29999" in joined
    assert "--nproc-per-node 2" in joined and "--max-restarts 1" in joined
    assert "--rdzv-conf is_host=true" in joined and "--shutdown-timeout 50" in joined
    other = slurm_torchrun_command(_slurm_env(SLURMD_NODENAME="gpu02"), [])
    assert "is_host=false" in other


def test_slurm_step_node_list_wins_over_job() -> None:
    # srun -N1 inside a 2-node job: the step has one node, so torchrun must not wait for two.
    env = _slurm_env(SLURM_STEP_NODELIST="gpu02", SLURM_STEP_NUM_NODES="1")
    cmd = slurm_torchrun_command(env, [])
    assert cmd[cmd.index("--nnodes") + 1] == "1"
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "gpu02:23456"


@pytest.mark.parametrize(
    "extra, nproc",
    [
        ({"SLURM_GPUS_ON_NODE": "8"}, 8),
        ({"SLURM_GPUS_ON_NODE": "", "SLURM_GPUS_PER_NODE": "a100:4"}, 4),
        ({"SLURM_GPUS_ON_NODE": "", "SLURM_GPUS_PER_NODE": "a100:2,h100:2"}, 4),
        ({"SLURM_GPUS_ON_NODE": "0", "SLURM_NTASKS_PER_NODE": "3"}, 3),
        ({"SLURM_GPUS_ON_NODE": "", "SLURM_NTASKS_PER_NODE": "2(x2)"}, 2),
        ({"NPROC_PER_NODE": "6"}, 6),
    ],
)
def test_slurm_nproc_per_node(extra: dict[str, str], nproc: int) -> None:
    assert slurm_nproc_per_node(_slurm_env(**extra)) == nproc


@pytest.mark.parametrize(
    "env, message",
    [
        ({"SLURM_JOB_NODELIST": ""}, "SLURM_JOB_NODELIST .*is not set"),
        ({"SLURM_JOB_ID": ""}, "SLURM_JOB_ID .*is not set"),
        ({"SLURM_NNODES": ""}, "SLURM_NNODES .*is not set"),
        ({"SLURM_NNODES": "3"}, "SLURM_NNODES=3 does not match the 2 hosts"),
        ({"SLURM_NNODES": "two"}, "SLURM_NNODES='two' .* not an integer"),
        ({"SLURM_JOB_NODELIST": "gpu[02-01]"}, "descending"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT='70000' .* not a TCP port"),
        ({"SLURM_GPUS_ON_NODE": "", "SLURM_NTASKS_PER_NODE": ""}, "cannot tell how many processes"),
        ({"SLURM_STEP_TASKS_PER_NODE": "4(x2)"}, "starts 4 launchers on a node"),
    ],
)
def test_slurm_bad_environment(env: dict[str, str], message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        slurm_torchrun_command(_slurm_env(**env), [])


def test_rendered_commands_parse_as_torchrun() -> None:
    # Guards against a misspelt flag: torchrun's own parser must accept every command we render.
    from torch.distributed.run import get_args_parser

    commands = [
        slurm_torchrun_command(_slurm_env(SLURMD_NODENAME="gpu01"), ["--config", "c.yaml"]),
        multinode_torchrun_command(
            {"MASTER_ADDR": "h", "NNODES": "2", "NODE_RANK": "1", "NPROC_PER_NODE": "2"}, []
        ),
        local_torchrun_command({"NPROC": "2", "MAX_RESTARTS": "1"}, ["--config", "c.yaml"]),
    ]
    for cmd in commands:
        args = get_args_parser().parse_args(cmd[len(TORCHRUN):])
        assert args.module and args.training_script == "spmdrl.train"
    slurm_args = get_args_parser().parse_args(commands[0][len(TORCHRUN):])
    assert slurm_args.signals_to_handle == SLURM_SIGNALS and slurm_args.rdzv_conf == "is_host=true"


# Local and multinode ----------------------------------------------------------


def test_local_command() -> None:
    assert local_torchrun_command({"NPROC": "2"}, ["--config", "a.yaml"]) == [
        *TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "spmdrl.train", "--config", "a.yaml",
    ]
    with pytest.raises(LaunchError, match="NPROC='0' .* at least 1"):
        local_torchrun_command({"NPROC": "0"}, [])


def test_multinode_command() -> None:
    env = {
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "6000",
        "NNODES": "2", "NODE_RANK": "0", "NPROC_PER_NODE": "8",
    }
    assert multinode_torchrun_command(env, ["--config", "a.yaml"]) == [
        *TORCHRUN, "--nnodes", "2", "--nproc-per-node", "8", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "10.0.0.1:6000", "--rdzv-id", "spmdrl", "--max-restarts", "3",
        "--rdzv-conf", "is_host=true", "-m", "spmdrl.train", "--config", "a.yaml",
    ]
    with pytest.raises(LaunchError, match="MASTER_ADDR is not set"):
        multinode_torchrun_command({"NNODES": "2", "NPROC_PER_NODE": "1"}, [])
    with pytest.raises(LaunchError, match="NODE_RANK=2 .* below NNODES=2"):
        multinode_torchrun_command({**env, "NODE_RANK": "2"}, [])


# CLI ------------------------------------------------------------------------


def test_cli_missing_nodelist_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    env = _slurm_env(SLURM_JOB_NODELIST="")
    assert main(["slurm", "--dry-run", "--", "--config", "x.yaml"], env=env) == 2
    err = capsys.readouterr().err
    assert err.startswith("spmdrl.launch: error: SLURM_JOB_NODELIST") and err.count("\n") == 1


def test_cli_dry_run_subprocess() -> None:
    env = _clean_env(**_slurm_env())
    out = subprocess.run(
        [sys.executable, "-m", "spmdrl.launch", "slurm", "--dry-run", "--"]
        + ["--config", "x.yaml", "--trainer.note", "a b"],
        env=env, capture_output=True, text=True, timeout=30, check=True,
    ).stdout
    assert out == (
        f"{PREFIX} --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint gpu01:23456 "
        f"--rdzv-id 123456 --max-restarts 3 --signals-to-handle {SLURM_SIGNALS} --shutdown-timeout 100 "
        "-m spmdrl.train --config x.yaml --trainer.note 'a b'\n"
    )


def test_cli_bad_config_is_one_line_before_torchrun(tmp_path: Path) -> None:
    # The trainer's checks run once in the launcher: one line and exit 2, no torchrun (whose restarts would
    # repeat the error on every rank of every attempt).
    proc = subprocess.run(
        [sys.executable, "-m", "spmdrl.launch", "local", "--nproc-per-node", "2", "--", "--config",
         str(REPO / "configs/grpo.yaml"), "--actor.lr", "fast"],
        env=_clean_env(), cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == 'spmdrl.train: error: config key "actor.lr": Expected a float. Got value: fast\n'


def test_cli_subprocess_error_exit_code() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "spmdrl.launch", "slurm", "--dry-run", "--", "--config", "x.yaml"],
        env=_clean_env(), capture_output=True, text=True, timeout=30,
    )
    assert proc.returncode == 2
    assert "SLURM_JOB_NODELIST" in proc.stderr and "Traceback" not in proc.stderr


# Shell scripts ----------------------------------------------------------------


def test_scripts_exist() -> None:
    names = {p.relative_to(REPO).as_posix() for p in SCRIPTS}
    assert {"launch/local.sh", "launch/multinode.sh", "slurm/grpo.sbatch", "slurm/ppo.sbatch"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_syntax(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    if shutil.which("shellcheck"):
        proc = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout


def test_local_sh_dry_run(tmp_path: Path) -> None:
    env = _clean_env(NPROC="2", SPMDRL_DRY_RUN="1", PYTHON=sys.executable)
    out = subprocess.run(
        ["bash", str(REPO / "launch/local.sh"), "--config", "configs/grpo.yaml"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30, check=True,
    ).stdout
    assert out == f"{PREFIX} --standalone --nproc-per-node 2 -m spmdrl.train --config configs/grpo.yaml\n"


def test_multinode_sh_dry_run(tmp_path: Path) -> None:
    env = _clean_env(MASTER_ADDR="node0", NNODES="2", NODE_RANK="1", NPROC_PER_NODE="4", SPMDRL_DRY_RUN="1",
                     PYTHON=sys.executable)
    out = subprocess.run(
        ["bash", str(REPO / "launch/multinode.sh"), "--config", "c.yaml"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30, check=True,
    ).stdout
    assert out == (
        f"{PREFIX} --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint node0:29500 "
        "--rdzv-id spmdrl --max-restarts 3 --rdzv-conf is_host=false -m spmdrl.train --config c.yaml\n"
    )
