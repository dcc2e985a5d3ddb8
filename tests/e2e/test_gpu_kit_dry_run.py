"""The GPU kit end to end on CPU with tiny sizes, as a lent GPU runs it: bench/gpu/session.sh's measuring
steps (their matrix.py commands) run the FSDP2 cells with each candidate flag, Megatron, the checkpoint save
+ resume and TRL's GRPOTrainer (trl-vllm, with transformers' generate on CPU), write the figures of each
into results.json and every run's output into matrix.log, and a cell that cannot run (vLLM absent) is
recorded, not fatal."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.e2e


def _session(step: str, out, spmdrl_cache: str) -> dict:
    """``bench/gpu/session.sh --dry-run STEP``: the device calls' script at tiny sizes on CPU; its results."""
    env = {**os.environ, "SPMDRL_CACHE": spmdrl_cache, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "OUT": str(out), "TMPDIR": str(out), "PYTHON": sys.executable}
    done = subprocess.run(["bash", "bench/gpu/session.sh", "--dry-run", step], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / step / "results.json").read_text())


def test_session_dry_run_on_cpu(tmp_path, spmdrl_cache):
    """The session's two measuring steps: every cell runs (or, without vLLM, is recorded as unable to) and
    reports the same figures; a variant's flags reach its run."""
    pytest.importorskip("megatron.core")
    pytest.importorskip("trl")
    results = _session("native", tmp_path, spmdrl_cache)
    more = _session("native-more", tmp_path, spmdrl_cache)
    by_cell = {c["cell"]: c for c in results["cells"] + more["cells"]}
    assert list(by_cell) == ["fsdp2-native", "fsdp2-native+eager", "fsdp2-native+micro128",
                             "fsdp2-native+awake", "fsdp2-native+main", "megatron-native", "checkpoint"]
    assert results["params"] == more["params"] == {"builtin:tiny": 4_460_800}
    for name, cell in by_cell.items():
        assert cell["rc"] == 0, (name, cell.get("error"))
        f = cell["figures"]
        assert f["tokens_per_s_per_gpu"] > 0 and f["step_s"] > 0 and f["response_length"] == 4.0
        assert {"rollout", "update", "weight_sync"} <= set(f["phase_s"]) and f["weight_sync_gb_per_s"] > 0
        assert f["overall_peak_gb"] > 0 and f["peak_gb"]["update"] > 0
        assert f["decode_tokens_per_s_per_gpu"] > 0
        assert f["colocated_over_larger_phase_peak"] >= 1.0
        assert f["update_mfu"] is None  # no peak FLOP/s is known for a CPU
    # The variants' flags reached their runs: an engine kept awake never sleeps.
    assert "sleep" in by_cell["fsdp2-native"]["figures"]["phase_s"]
    assert "sleep" not in by_cell["fsdp2-native+awake"]["figures"]["phase_s"]
    assert by_cell["fsdp2-native+eager"]["variant_args"] == ["--model.use_torch_compile", "false"]
    ckpt = by_cell["checkpoint"]["checkpoint"]
    assert ckpt["resumed_ok"] and ckpt["resumed_step"] == 2 and ckpt["steps_logged"] == [1, 2, 3]
    assert ckpt["saved_mib"] > 0 and ckpt["save_s"] >= 0
    assert "| sized | megatron-native | 0 |" in more["table"]
    # The runs' folders stay out of OUT: the device tool brings back 8 files at most.
    assert sorted(q.name for q in (tmp_path / "native").iterdir()) == ["matrix.log", "results.json"]

    results = _session("vllm", tmp_path, spmdrl_cache)
    by_cell = {c["cell"]: c for c in results["cells"]}
    assert list(by_cell) == ["trl-vllm", "fsdp2-vllm-sleep1", "vllm-alone", "fsdp2-vllm-sleep1+gap"]
    trl = by_cell["trl-vllm"]  # the same figures, from TRL's own timers
    assert trl["rc"] == 0, trl.get("error")
    assert trl["trl"] == {"generate": "transformers", "optimizer_steps_per_step": 1}
    f = trl["figures"]
    assert f["tokens_per_s_per_gpu"] > 0 and f["step_s"] > 0 and f["response_length"] == 4.0
    assert f["phase_s"]["rollout"] > 0 and f["phase_s"]["update"] > 0 and f["phase_s"]["ref"] > 0
    assert f["decode_tokens_per_s_per_gpu"] > 0 and f["update_mfu"] is None
    runs = tmp_path / "spmdrl-session-runs"
    rows = [json.loads(line) for line in (runs / "sized-trl-vllm" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # TRL's step: 2 prompts x 2 responses of 4 tokens and their prompts; its phases add up
        assert r["perf/tokens_per_s"] * r["timing/step"] > 16
        phases = sum(v for k, v in r.items() if k.startswith("timing/") and k != "timing/step")
        assert phases == pytest.approx(r["timing/step"])
    if importlib.util.find_spec("vllm") is None:  # these cells cannot run here; the matrix went on past them
        assert by_cell["fsdp2-vllm-sleep1"]["rc"] == 2 and "vLLM is not installed" in by_cell[
            "fsdp2-vllm-sleep1"]["error"]
        assert by_cell["vllm-alone"]["rc"] != 0
        assert by_cell["fsdp2-vllm-sleep1+gap"]["variant_args"] == ["--rollout.calculate_log_probs", "true"]
    log = (tmp_path / "vllm" / "matrix.log").read_text()
    assert all(f"===== sized {c}" in log for c in by_cell)
    assert "| sized | trl-vllm | 0 |" in results["table"]
