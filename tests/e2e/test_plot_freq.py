"""trainer.plot_freq: a training run draws its own figures into {output_dir}/plots (one rank, in the shared
jobs: tests/e2e/shared_runs.py)."""

from __future__ import annotations

import pytest
from conftest import TINY
from shared_runs import declare

pytestmark = pytest.mark.e2e


declare("plot_freq", [*TINY, "--trainer.total_steps", "2", "--rollout.n", "2", "--trainer.plot_freq", "1",
                      "--data.val_files", "null", "--trainer.output_dir", "{base}/plot_freq"], nproc=1)


def test_plot_freq_writes_figures_during_the_run(shared) -> None:
    from spmdrl.plot import FIGURES

    out = shared.path("plot_freq")
    assert len(shared.rows("plot_freq")) == 2
    pngs = sorted(p.name for p in (out / "plots").iterdir())
    # No validation ran, yet reward.png exists: its training-reward panel has data.
    assert pngs == sorted(f"{name}.png" for name in FIGURES)
    assert all((out / "plots" / name).stat().st_size > 10_000 for name in pngs)
