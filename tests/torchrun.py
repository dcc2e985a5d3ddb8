"""Run a program under ``torchrun --standalone`` in a subprocess from the repository root: the one launcher
of every test that starts ranks as a user does (tests/e2e/conftest.py's ``train``, the matrix driver, the
scripted multi-turn run, the library engines' loop tests in tests/engine_loop.py and tests/vllm_engine)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Sequence

REPO = Path(__file__).resolve().parents[1]


def child_env(env: Mapping[str, str] | None = None, *, threads: str = "1") -> dict[str, str]:
    """This process's environment with the repository importable, the hub offline and ``threads`` OpenMP
    threads a process, then ``env`` on top."""
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": threads,
            **(env or {})}


def run_in_repo(cmd: Sequence[str], *, env: Mapping[str, str], timeout: float, check: bool
                ) -> subprocess.CompletedProcess:
    """``cmd`` from the repository root, output captured. ``check``: a nonzero exit fails the test with the
    command and the tail of its stderr."""
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {out.returncode}\n--- stderr (tail)\n"
                             f"{out.stderr[-4000:]}")
    return out


def torchrun(program: Sequence[str], *, nproc: int, env: Mapping[str, str] | None = None,
             timeout: float = 600, check: bool = True, launcher_args: Sequence[str] = ()
             ) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node nproc *launcher_args *program`` (``program``: ``["-m",
    module, *args]`` or ``[script, *args]``) with ``child_env(env)``: one OpenMP thread a rank, as the ranks
    share the CPU cores. ``check`` as in ``run_in_repo``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           *launcher_args, *program]
    return run_in_repo(cmd, env=child_env(env), timeout=timeout, check=check)
