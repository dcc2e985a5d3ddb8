"""Validation as verl reports it, end to end: rollout.val_kwargs.n = 4 sampled responses per prompt under
torchrun with 2 ranks, trainer.val_only (validate the initial weights, log, exit); and the same metrics from
1 rank and from 2 ranks holding unequal shares of the prompts. The runs are in the shared jobs
(tests/e2e/shared_runs.py)."""

from __future__ import annotations

import math

import pytest
from conftest import TINY
from shared_runs import declare, prepare

pytestmark = pytest.mark.e2e


@prepare
def _inputs(base) -> None:
    from spmdrl.builtin.tasks import get_task, write_parquet

    (base / "val_only").mkdir(exist_ok=True)
    write_parquet(get_task("arith")("val", 12, 0), base / "val_only" / "val12.parquet")  # 12 x 4 responses
    # 5 prompts in batches of 4: rank 0 gets 3, rank 1 gets 2, so a mean of per-rank means would differ.
    write_parquet(get_task("arith")("val", 5, 0), base / "val_only" / "val5.parquet")
    (base / "val_only" / "reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    h = sum(map(ord, str(ground_truth) + solution_str))\n"
        "    return {'score': h % 7 / 7, 'acc': float(h % 2), 'pred': str(h % 3)}\n")


declare("val_only/k4", [*TINY, "--data.val_files", "{base}/val_only/val12.parquet",
                        "--trainer.val_only", "true", "--rollout.val_kwargs.n", "4",
                        "--rollout.val_kwargs.do_sample", "true", "--rollout.val_kwargs.temperature", "1.0",
                        "--trainer.output_dir", "{base}/val_only/k4"])
# Greedy responses (the same on 1 and 2 ranks in float32) and a reward that varies with the prompt and the
# text: the per-source means must not depend on how the prompts were split over ranks.
for _n in (1, 2):
    declare(f"val_only/ranks{_n}", [*TINY, "--data.val_files", "{base}/val_only/val5.parquet",
                                    "--data.val_batch_size", "4", "--trainer.val_only", "true",
                                    "--rollout.val_kwargs.n", "4", "--reward.function",
                                    "{base}/val_only/reward.py:compute_score", "--rollout.dtype", "float32",
                                    "--actor.param_dtype", "float32",
                                    "--trainer.output_dir", f"{{base}}/val_only/ranks{_n}"], nproc=_n)


def test_val_only_writes_k4_metrics(shared) -> None:
    rows = shared.rows("val_only/k4")
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
    assert (row[f"val-core/{src}/acc/pass@4"] >= row[f"val-aux/{src}/acc/pass@2"]
            >= row[f"val-core/{src}/acc/mean@4"])


def test_validation_metrics_equal_on_one_and_two_ranks(shared) -> None:
    rows = {n: shared.rows(f"val_only/ranks{n}")[0] for n in (1, 2)}
    assert rows[1].keys() == rows[2].keys()
    keys = [k for k in rows[1] if k.startswith("val-")]
    assert "val-core/spmdrl/arith/acc/pass@4" in keys and "val-core/spmdrl/arith/acc/maj@4/mean" in keys
    for key in keys:
        assert math.isclose(rows[1][key], rows[2][key], rel_tol=1e-9, abs_tol=1e-12), (key, rows[1][key],
                                                                                       rows[2][key])
    assert 0 < rows[1]["val-aux/spmdrl/arith/reward/mean@4"] < 1  # not a degenerate all-equal reward
