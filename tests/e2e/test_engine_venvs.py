"""Runs each library rollout engine's tests inside its own venv: tests/vllm_engine in .venv-vllm and
tests/sglang_engine in .venv-sglang (made by .ci/vllm-venv and .ci/sglang-venv, which the README's test
command runs first). The libraries bring their own pins, so their tests run in a pytest of their own, whose
summary is printed here. When this environment has the library itself, its tests run directly and this one
skips."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from spmdrl.rollout.sglang import sglang_available
from spmdrl.rollout.vllm import vllm_available

REPO = Path(__file__).resolve().parents[2]
# engine -> (its availability check, the library's name)
ENGINES = {"vllm": (vllm_available, "vLLM"), "sglang": (sglang_available, "SGLang")}


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("engine", list(ENGINES))
def test_engine_suite_in_its_venv(engine, spmdrl_cache):
    available, library = ENGINES[engine]
    venv, folder = REPO / f".venv-{engine}", f"tests/{engine}_engine"
    if available() is None:
        pytest.skip(f"{library} is installed in this environment: {folder} ran here directly")
    failed = REPO / f".venv-{engine}.failed"
    if failed.exists():
        pytest.skip(f".ci/{engine}-venv could not build {venv.name}: {failed.read_text().strip()}")
    if not (venv / "bin" / "python").exists():
        pytest.skip(f"no {venv.name}: run .ci/{engine}-venv (the README's test command does) to test the "
                    f"{engine} engine")
    cmd = [str(venv / "bin" / "python"), "-m", "pytest", folder, "-q", "-ra", "-p", "no:cacheprovider"]
    env = {**os.environ, "SPMDRL_CACHE": spmdrl_cache, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    summary = (run.stdout[run.stdout.rfind("short test summary"):] if "short test summary" in run.stdout
               else "")
    print(f"{' '.join(cmd)} -> exit {run.returncode}\n{summary or run.stdout[-3000:]}")
    # 0: passed (skips allowed); 5: nothing ran, handled below; anything else is a failure.
    assert run.returncode in (0, 5), run.stdout[-6000:] + run.stderr[-3000:]
    passed = re.search(r"(\d+) passed", run.stdout)
    if passed is None:  # every test skipped (the library cannot run on this CPU?): say why, never silently
        reasons = re.findall(r"SKIPPED \[\d+\] [^:]+:\d+: (.*)", run.stdout)
        why = "; ".join(sorted(set(reasons))) or run.stdout[-500:]
        pytest.skip(f"{folder} skipped in {venv.name}: {why}")
