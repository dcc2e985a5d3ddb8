"""Runs tests/sglang_engine inside .venv-sglang (made by .ci/sglang-venv, which the README's test command
runs first): SGLang lives in a third environment, so its tests run in a pytest of their own, whose summary
is printed here. When this environment has SGLang itself, tests/sglang_engine run directly and this one
skips."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from spmdrl.rollout.sglang import sglang_available

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv-sglang"


@pytest.mark.e2e
@pytest.mark.slow
def test_sglang_suite_in_its_venv(spmdrl_cache):
    if sglang_available() is None:
        pytest.skip("SGLang is installed in this environment: tests/sglang_engine ran here directly")
    failed = REPO / ".venv-sglang.failed"
    if failed.exists():
        pytest.skip(f".ci/sglang-venv could not build {VENV.name}: {failed.read_text().strip()}")
    if not (VENV / "bin" / "python").exists():
        pytest.skip(f"no {VENV.name}: run .ci/sglang-venv (the README's test command does) to test the "
                    f"sglang engine")
    cmd = [str(VENV / "bin" / "python"), "-m", "pytest", "tests/sglang_engine", "-q", "-ra",
           "-p", "no:cacheprovider"]
    env = {**os.environ, "SPMDRL_CACHE": spmdrl_cache, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    summary = (run.stdout[run.stdout.rfind("short test summary"):] if "short test summary" in run.stdout
               else "")
    print(f"{' '.join(cmd)} -> exit {run.returncode}\n{summary or run.stdout[-3000:]}")
    # 0: passed (skips allowed); 5: nothing ran, handled below; anything else is a failure.
    assert run.returncode in (0, 5), run.stdout[-6000:] + run.stderr[-3000:]
    passed = re.search(r"(\d+) passed", run.stdout)
    if passed is None:  # every test skipped: say why, never silently
        reasons = re.findall(r"SKIPPED \[\d+\] [^:]+:\d+: (.*)", run.stdout)
        pytest.skip(f"tests/sglang_engine skipped in {VENV.name}: "
                    f"{'; '.join(sorted(set(reasons))) or run.stdout[-500:]}")
