"""The memory plan against measured memory: planned and measured peak GB of every phase, per config.

    python bench/memory_plan.py                        # the configs tests/e2e/test_memory_plan.py checks
    python bench/memory_plan.py --vllm-python .venv-vllm/bin/python --sglang-python .venv-sglang/bin/python

Each config runs 2 steps of ``python -m spmdrl.train`` (torchrun where it has 2 ranks) with
``trainer.exact_memory`` (each phase's CPU resident peak its own: the heap is trimmed at each phase
start); the plan is the run's own plan.json, made before any model existed. On a GPU the measured figure is
torch's max_memory_allocated. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "e2e"))

from test_memory_plan import MEASURED, RUNS  # noqa: E402  (the test's configs, one source)

LOOP = ["--config", "configs/grpo.yaml", "--data.train_batch_size", "8", "--actor.ppo_mini_batch_size", "4",
        "--trainer.total_steps", "3"]


def measure(name: str, nproc: int, argv: list[str], python: str, tmp: Path) -> list[tuple]:
    out = tmp / name.replace(" ", "_").replace(",", "")
    args = [*argv, *MEASURED, "--trainer.output_dir", str(out)]
    cmd = ([python, "-m", "spmdrl.train", *args] if nproc == 1 else
           [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m",
            "spmdrl.train", *args])
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1" if nproc > 1 else "2"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    plan = json.loads((out / "plan.json").read_text())["peak_gb"]
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    return [(name, nproc, phase, gb, last[f"memory/{phase}_peak_gb"]) for phase, gb in plan.items()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", help="python of .venv-vllm: adds the vLLM config (2 ranks)")
    p.add_argument("--sglang-python", help="python of .venv-sglang: adds the SGLang config (2 ranks)")
    a = p.parse_args()
    runs = {name: (nproc, argv, sys.executable) for name, (nproc, argv) in RUNS.items()}
    for engine, python in (("vllm", a.vllm_python), ("sglang", a.sglang_python)):
        if python:
            runs[f"{engine} rollout"] = (2, [*LOOP, "--rollout.engine", engine], python)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (nproc, argv, python) in runs.items():
            rows += measure(name, nproc, argv, python, Path(tmp))
    print("\n| config | ranks | phase | planned GB | measured GB | planned / measured |")
    print("|---|---|---|---|---|---|")
    for name, nproc, phase, planned, measured in rows:
        print(f"| {name} | {nproc} | {phase} | {planned:.3f} | {measured:.3f} | {planned / measured:.2f} |")


if __name__ == "__main__":
    main()
