"""End-to-end helpers: run ``python -m spmdrl.train`` (alone or under torchrun) in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import shared_runs
from torchrun import child_env, run_in_repo, torchrun

REPO = Path(__file__).resolve().parents[2]

# Small sizes that keep one step to about a second on 2 CPU cores. Eager RMSNorm/SwiGLU: the compiled ones
# cost a run ~3 s of tracing and loading (even from inductor's cache) for nothing these runs check; they are
# checked against eager in tests/unit/test_fused.py and run in the default-config runs (the main job in
# test_learning.py and test_isa_hidden.py, the combination matrix).
TINY = [
    "--data.train_batch_size", "4", "--actor.ppo_mini_batch_size", "4", "--critic.ppo_mini_batch_size", "4",
    "--data.max_response_length", "8", "--model.fused_kernels", "off", "--trainer.progress_bar", "false",
    "--trainer.resume", "off",
]


@pytest.fixture(scope="session")
def spmdrl_cache(tmp_path_factory) -> str:
    """One cache of built-in models and tasks for every run of the session ($SPMDRL_CACHE when set)."""
    return os.environ.get("SPMDRL_CACHE") or str(tmp_path_factory.mktemp("spmdrl_cache"))


@pytest.fixture(scope="session")
def shared(tmp_path_factory, spmdrl_cache) -> shared_runs.SharedRuns:
    """Every run the test modules declared (tests/e2e/shared_runs.py), run on first use in a few jobs."""
    return shared_runs.run_all(tmp_path_factory.mktemp("shared"), spmdrl_cache)


def train(args: list[str], *, cache: str, nproc: int = 1, env: dict | None = None, timeout: float = 600,
          check: bool = True, extra_torchrun: list[str] = (), module: str = "spmdrl.train"
          ) -> subprocess.CompletedProcess:
    """Run the trainer (``module``: spmdrl.sft for SFT); ``nproc > 1`` goes through torchrun --standalone."""
    env = {"SPMDRL_CACHE": cache, **(env or {})}
    if nproc > 1 or extra_torchrun:
        return torchrun(["-m", module, *args], nproc=nproc, env=env, timeout=timeout, check=check,
                        launcher_args=extra_torchrun)
    return run_in_repo([sys.executable, "-m", module, *args], timeout=timeout, check=check,
                       env=child_env(env, threads=os.environ.get("OMP_NUM_THREADS", "2")))


def read_metrics(out_dir: Path) -> list[dict]:
    with open(Path(out_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


# The main job's validation with 4 sampled answers (temperature 1, as in training) per prompt: 512 answers
# average out the ~0.1 swing of one step's training reward.
SAMPLED_VAL = ["--trainer.val_before_train", "true", "--rollout.val_kwargs.n", "4",
               "--rollout.val_kwargs.do_sample", "true", "--rollout.val_kwargs.temperature", "1.0"]
SAMPLED_VAL_REWARD = "val-aux/spmdrl/arith/reward/mean@4"


def main_job_argv(out: str, steps: int) -> list[str]:
    """The main job's arguments for ``steps`` steps with sampled validation before and after."""
    return ["--config", "configs/grpo.yaml", "--trainer.total_steps", str(steps), "--trainer.test_freq",
            str(steps), *SAMPLED_VAL, "--trainer.progress_bar", "false", "--trainer.resume", "off",
            "--trainer.output_dir", out]
