"""The CPU without native bf16, proved on whatever machine CI lands on: AVX-512 hidden by environment.

``ONEDNN_MAX_CPU_ISA=AVX2`` caps oneDNN (and spmdrl's native-bf16 check reads it
too, see spmdrl/precision.py) and ``ATEN_CPU_CAPABILITY=avx2`` makes torch, and
the native engine's C++ kernels, dispatch at AVX2. Both are read at process
start, so every run here is a subprocess. On an AVX2-only machine they change
nothing and these tests repeat the plain ones; on an AVX-512 machine they take
the paths an AVX2 machine takes: float32 by ``auto``, no bf16 prepacking,
AVX2 kernels. Picked for the hardware decisions they exercise: the decisions
themselves, the rollout engine's tests, the main job (short) and a
checkpoint/resume (the last two in a shared job of their own, tests/e2e/shared_runs.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, SAMPLED_VAL_REWARD, TINY, main_job_argv
from shared_runs import declare

pytestmark = pytest.mark.e2e

HIDDEN = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
_PROBE = """
import json, torch
from spmdrl.precision import can_prepack, native_bf16, resolve_dtype
print(json.dumps({
    "native_bf16": native_bf16("cpu")[0],
    "auto": str(resolve_dtype("auto", "cpu")),
    "prepack_bf16": can_prepack(torch.device("cpu"), torch.bfloat16),
    "prepack_fp32": can_prepack(torch.device("cpu"), torch.float32),
    "capability": torch.backends.cpu.get_cpu_capability(),
}))
"""


declare("isa_hidden/grpo", main_job_argv("{base}/isa_hidden/grpo", steps=40), job_env=HIDDEN)
CKPT = ["--config", "configs/grpo.yaml", *TINY[:-2], "--rollout.n", "2", "--trainer.save_freq", "2",
        "--trainer.output_dir", "{base}/isa_hidden/ckpt"]
declare("isa_hidden/ckpt", [*CKPT, "--trainer.total_steps", "2"], job_env=HIDDEN)
declare("isa_hidden/ckpt_resumed", [*CKPT, "--trainer.total_steps", "3"], job_env=HIDDEN)


def _python(code_or_args: list[str], env: dict) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(REPO), **env}
    return subprocess.run([sys.executable, *code_or_args], cwd=REPO, env=full, capture_output=True, text=True,
                          timeout=900)


def test_hiding_flips_every_hardware_decision():
    out = _python(["-c", _PROBE], HIDDEN)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["native_bf16"] is False and seen["auto"] == "torch.float32"
    assert seen["prepack_bf16"] is False
    assert seen["capability"] in ("AVX2", "DEFAULT")  # the kernels build for what torch dispatches to
    visible = json.loads(_python(["-c", _PROBE], {}).stdout.strip().splitlines()[-1])
    print(f"\nvisible ISA: {visible}\nhidden ISA:  {seen}")  # in CI's log: what this machine decided


def test_rollout_tests_with_isa_hidden(spmdrl_cache):
    files = ["tests/unit/test_native_rollout.py", "tests/unit/test_native_kernels.py",
             "tests/unit/test_precision.py"]
    out = _python(["-m", "pytest", "-q", "-p", "no:cacheprovider", *files],
                  {**HIDDEN, "SPMDRL_CACHE": spmdrl_cache})
    assert out.returncode == 0, out.stdout[-4000:]
    print("\n" + out.stdout.strip().splitlines()[-1])


def test_main_job_short_with_isa_hidden(shared):
    """The README's main job with the defaults, shortened, in float32: 2 ranks, sampled validation accuracy
    rises from the SFT warm start (tests/e2e/test_learning.py: the same check in this machine's precision)."""
    rows = shared.rows("isa_hidden/grpo")
    assert "precision: compute float32, rollout float32 (auto: ONEDNN_MAX_CPU_ISA=AVX2" in shared.stdout(
        "isa_hidden/grpo")
    before, after = rows[0][SAMPLED_VAL_REWARD], rows[-1][SAMPLED_VAL_REWARD]
    assert after > before + 0.04, (before, after)


def test_checkpoint_resume_with_isa_hidden(shared):
    shared.ran("isa_hidden/ckpt")
    run = shared.stdout("isa_hidden/ckpt_resumed")
    assert "resumed from" in run and "at step 2" in run
    assert [r["step"] for r in shared.rows("isa_hidden/ckpt_resumed", out="isa_hidden/ckpt")] == [1, 2, 3]
