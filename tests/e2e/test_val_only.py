"""Validation as verl reports it, end to end: rollout.val_kwargs.n = 4 sampled responses per prompt under
torchrun with 2 ranks, trainer.val_only (validate the initial weights, log, exit)."""

from __future__ import annotations

import pytest

from conftest import TINY, read_metrics, train

pytestmark = pytest.mark.e2e


def test_val_only_writes_k4_metrics(tmp_path, spmdrl_cache) -> None:
    from spmdrl.tasks import get_task
    from spmdrl.tools.make_task import write_parquet

    val = write_parquet(get_task("arith")("val", 12, 0), tmp_path / "val.parquet")  # 12 prompts x 4 responses
    out = tmp_path / "run"
    train([*TINY, "--data.val_files", str(val), "--trainer.val_only", "true", "--rollout.val_kwargs.n", "4",
           "--rollout.val_kwargs.do_sample", "true", "--rollout.val_kwargs.temperature", "1.0",
           "--trainer.output_dir", str(out)], cache=spmdrl_cache, nproc=2)
    rows = read_metrics(out)
    assert len(rows) == 1 and rows[0]["step"] == 0  # validated once, trained never
    row = rows[0]
    assert not any(k.startswith("actor/") for k in row)
    src = "spmdrl/arith"  # its scorer returns acc (the core variable, as in verl) and pred (the vote)
    for name in ("mean@4", "best@4/mean", "best@4/std", "maj@4/mean", "pass@4"):
        assert 0.0 <= row[f"val-core/{src}/acc/{name}"] <= 1.0, name
    for name in ("std@4", "best@2/mean", "worst@4/mean", "maj@2/mean", "pass@2"):
        assert f"val-aux/{src}/acc/{name}" in row, name
    for name in ("mean@4", "best@4/mean", "worst@4/mean", "maj@4/mean"):
        assert f"val-aux/{src}/reward/{name}" in row, name
    # The random model's sampled responses differ within a prompt: best of 4 above the mean, worst below.
    reward = {k.split("/reward/")[1]: v for k, v in row.items() if k.startswith(f"val-aux/{src}/reward/")}
    assert reward["worst@4/mean"] < reward["mean@4"] < reward["best@4/mean"], reward
    assert row[f"val-core/{src}/acc/pass@4"] >= row[f"val-aux/{src}/acc/pass@2"] >= row[f"val-core/{src}/acc/mean@4"]
