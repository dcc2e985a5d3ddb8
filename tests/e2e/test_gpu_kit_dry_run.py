"""The GPU kit's matrix (bench/gpu/matrix.py) end to end on CPU with tiny sizes: one command runs the
FSDP2 and Megatron cells, the checkpoint save + resume and TRL's GRPOTrainer (trl-vllm, with transformers'
generate on CPU), writes the figures of each into results.json and every run's output into matrix.log, and
a cell that cannot run (vLLM absent) is recorded, not fatal."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.e2e


def test_matrix_dry_run_on_cpu(tmp_path, spmdrl_cache):
    pytest.importorskip("megatron.core")
    pytest.importorskip("trl")
    cells = ["fsdp2-native", "fsdp2-vllm-sleep1", "megatron-native", "checkpoint", "trl-vllm"]
    cmd = [sys.executable, "bench/gpu/matrix.py", "--device", "cpu", "--shapes", "sized",
           "--model", "builtin:tiny", "--steps", "2", "--prompts", "2", "--n", "2", "--new-tokens", "4",
           "--micro", "4",
           "--out", str(tmp_path / "out"), "--site", str(tmp_path / "site"), "--cells", *cells]
    env = {**os.environ, "SPMDRL_CACHE": spmdrl_cache, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    by_cell = {c["cell"]: c for c in results["cells"]}
    assert list(by_cell) == cells and results["params"] == {"builtin:tiny": 4_460_800}
    for name in ("fsdp2-native", "megatron-native", "checkpoint"):
        cell = by_cell[name]
        assert cell["rc"] == 0, cell.get("error")
        f = cell["figures"]
        assert f["tokens_per_s_per_gpu"] > 0 and f["step_s"] > 0 and f["response_length"] == 4.0
        assert {"rollout", "update", "weight_sync"} <= set(f["phase_s"]) and f["weight_sync_gb_per_s"] > 0
        assert f["overall_peak_gb"] > 0 and f["peak_gb"]["update"] > 0
        assert f["decode_tokens_per_s_per_gpu"] > 0
        assert f["colocated_over_larger_phase_peak"] >= 1.0
        assert f["update_mfu"] is None  # no peak FLOP/s is known for a CPU
    trl = by_cell["trl-vllm"]  # the same figures, from TRL's own timers
    assert trl["rc"] == 0, trl.get("error")
    assert trl["trl"] == {"generate": "transformers", "optimizer_steps_per_step": 1}
    f = trl["figures"]
    assert f["tokens_per_s_per_gpu"] > 0 and f["step_s"] > 0 and f["response_length"] == 4.0
    assert f["phase_s"]["rollout"] > 0 and f["phase_s"]["update"] > 0 and f["phase_s"]["ref"] > 0
    assert f["decode_tokens_per_s_per_gpu"] > 0 and f["update_mfu"] is None
    rows = [json.loads(line) for line in (tmp_path / "out" / "runs" / "sized-trl-vllm" / "metrics.jsonl")
            .read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # TRL's step: 2 prompts x 2 responses of 4 tokens and their prompts; its phases add up
        assert r["perf/tokens_per_s"] * r["timing/step"] > 16
        phases = sum(v for k, v in r.items() if k.startswith("timing/") and k != "timing/step")
        assert phases == pytest.approx(r["timing/step"])
    ckpt = by_cell["checkpoint"]["checkpoint"]
    assert ckpt["resumed_ok"] and ckpt["resumed_step"] == 2 and ckpt["steps_logged"] == [1, 2, 3]
    assert ckpt["saved_mib"] > 0 and ckpt["save_s"] >= 0
    if importlib.util.find_spec("vllm") is None:  # this cell cannot run here; the matrix went on past it
        assert by_cell["fsdp2-vllm-sleep1"]["rc"] == 2 and "vLLM is not installed" in by_cell[
            "fsdp2-vllm-sleep1"]["error"]
    log = (tmp_path / "out" / "matrix.log").read_text()
    assert all(f"===== sized {c}" in log for c in cells)
    assert "| sized | megatron-native | 0 |" in results["table"]
    assert "| sized | trl-vllm | 0 |" in results["table"]
