"""The GPU kit's carry (bench/gpu/): a wheel cut into parts over chunks is joined, checked and installed on
the far side only once every part has arrived, and a damaged file is refused; each package is pinned in one
pin file; TRL's timers become spmdrl's phases (bench/trl_grpo.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "gpu"))
sys.path.insert(0, str(REPO / "bench"))

import build_carry  # noqa: E402
import matrix  # noqa: E402
import trl_grpo  # noqa: E402


def _chunks(tmp_path: Path, limit: int) -> list[dict]:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    build_carry._stand_in_wheel(wheels, "kit-big", "1.0")  # ~700 bytes: cut into parts of ``limit``
    build_carry._stand_in_wheel(wheels, "kit-small", "2.0")
    big, small = sorted(wheels.glob("*.whl"))
    (tmp_path / "parts").mkdir()
    items = build_carry.pieces([big], limit, tmp_path / "parts")
    assert len(items) > 1 and all(e["bytes"] <= limit for _, e in items)
    small_item = (small, {"file": small.name, "bytes": small.stat().st_size,
                          "sha256": build_carry.sha256(small)})
    chunks = [[items[0], small_item]] + [[it] for it in items[1:]]  # the parts travel in separate commands
    return build_carry.write_chunks(tmp_path / "carry", chunks, ["core"] + ["vllm"] * (len(chunks) - 1))


def test_parts_join_across_commands_and_install(tmp_path):
    manifest = _chunks(tmp_path, limit=300)
    carry, site = tmp_path / "carry", tmp_path / "site"
    assert json.loads((carry / "manifest.json").read_text()) == manifest
    first = matrix.install([carry / "c1"], site)
    assert first == ["kit_small-2.0+image-py3-none-any.whl"]  # the big wheel waits for its other parts
    assert not list(site.glob("kit_big*"))
    rest = matrix.install([carry / m["chunk"] for m in manifest[1:]], site)
    assert rest == ["kit_big-1.0+image-py3-none-any.whl"]
    assert (site / "kit_big-1.0+image.dist-info" / "METADATA").is_file()
    assert (site / "kit_small-2.0+image.dist-info" / "METADATA").is_file()  # a later install kept it


def test_a_damaged_part_is_refused(tmp_path):
    manifest = _chunks(tmp_path, limit=300)
    part = tmp_path / "carry" / "c2" / manifest[1]["files"][0]["file"]
    part.write_bytes(b"x" + part.read_bytes()[1:])
    with pytest.raises(SystemExit, match="sha256 differs"):
        matrix.install([tmp_path / "carry" / "c2"], tmp_path / "site")


def test_packing_keeps_chunks_under_the_limit():
    items = [(Path(f"w{i}"), {"bytes": b}) for i, b in enumerate([50, 40, 30, 20, 20, 10, 5])]
    chunks = build_carry.pack(items, 60, [])
    assert [sum(e["bytes"] for _, e in c) for c in chunks] == [60, 60, 55]  # 175 bytes: 3 chunks at least
    first = [(Path("c1"), {"bytes": 45})]
    filled = build_carry.pack(items[-2:], 60, [first])
    assert len(filled) == 1 and sum(e["bytes"] for _, e in filled[0]) == 60


def test_figures_from_metrics_rows():
    """Warm-up step left out, per-GPU throughput, weight sync only from steps that loaded weights (step 1's
    engine already holds them), the colocated peak over the larger phase and the update's MFU."""
    def row(step, sync):
        return {"step": step, "timing/step": 2.0, "timing/rollout": 1.0, "timing/update": 0.5,
                "timing/weight_sync": sync, "perf/tokens_per_s": 1000.0 * step, "response_length/mean": 10.0,
                "memory/rollout_peak_gb": 4.0, "memory/update_peak_gb": 5.0,
                "memory/weight_sync_peak_gb": 6.0, "memory/overall_peak_gb": 6.0}

    f = matrix.figures([row(1, 0.0), row(2, 0.25), row(3, 0.25)], world=2, responses=8, params=10**9,
                       weight_bytes=2, peak_tflops=1000.0)
    assert f["steps_measured"] == 2 and f["tokens_per_s_per_gpu"] == 1250.0  # median of 2000, 3000; 2 GPUs
    assert f["weight_sync_s"] == 0.25 and f["weight_gb"] == 2.0 and f["weight_sync_gb_per_s"] == 8.0
    assert f["decode_tokens_per_s_per_gpu"] == 40.0  # 8 responses / 2 GPUs x 10 tokens / 1 s
    assert f["colocated_over_larger_phase_peak"] == 1.2  # 6 GB while syncing over the update's 5
    assert f["update_mfu"] == 6 * 10**9 * 1250.0 * 2.0 / 0.5 / 1e15
    only = matrix.figures([row(1, 1e-5)], world=1, responses=8, params=10**9, weight_bytes=2,
                          peak_tflops=None)
    assert only["weight_sync_s"] is None and only["weight_sync_gb_per_s"] is None
    assert only["update_mfu"] is None


def test_each_package_is_pinned_once():
    """core.txt, vllm.txt and trl.txt: each holds what the ones before it do not (trl.txt: TRL 1.16.0 and what
    it needs beyond the image and vLLM's pins)."""
    pins = {part: build_carry.read_pins(part) for part in build_carry.REQUIREMENTS}
    names = [n for p in pins.values() for n in p]
    assert len(names) == len(set(names))
    assert pins["trl"]["trl"][0] == "1.16.0" and "datasets" in pins["trl"] and "dill" in pins["vllm"]


def test_trl_timers_become_phases():
    """A step of TRL's timers (name, start, seconds): old and reference log-probs are the forwards inside
    _prepare_inputs (the reference's last), the loss's forward after it is the update's; the phases add up to
    the step."""
    logps = "_get_per_token_logps_and_entropies"
    timers = [("sync_weights", 0.0, 0.5), ("vLLM.generate", 0.5, 2.0), ("_calculate_rewards", 2.5, 0.1),
              (logps, 2.6, 0.3), (logps, 2.9, 0.2), ("_prepare_inputs", 0.0, 3.2), (logps, 3.3, 0.4),
              ("compute_loss", 3.3, 0.5)]
    got = trl_grpo.phases(timers, 4.0, beta=0.02)
    assert got == pytest.approx({"rollout": 2.0, "weight_sync": 0.5, "reward": 0.1, "old_logp": 0.3,
                                 "ref": 0.2, "update": 0.8, "other": 0.1})
    hf = [("transformers.generate", 0.0, 1.0), (logps, 1.0, 0.2), ("_prepare_inputs", 0.0, 1.5)]
    one = trl_grpo.phases(hf, 2.0, beta=0.02)
    assert one == pytest.approx({"rollout": 1.0, "reward": 0.0, "ref": 0.2, "update": 0.5, "other": 0.3})
