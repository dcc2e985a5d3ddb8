"""trainer.plot_freq: a training run draws its own figures into {output_dir}/plots."""

from __future__ import annotations

import pytest
from conftest import TINY, read_metrics, train

pytestmark = pytest.mark.e2e


def test_plot_freq_writes_figures_during_the_run(tmp_path, spmdrl_cache) -> None:
    from spmdrl.plot import FIGURES

    out = tmp_path / "run"
    train([*TINY, "--trainer.total_steps", "2", "--rollout.n", "2", "--trainer.plot_freq", "1",
           "--data.val_files", "null", "--trainer.output_dir", str(out)], cache=spmdrl_cache)
    assert len(read_metrics(out)) == 2
    pngs = sorted(p.name for p in (out / "plots").iterdir())
    # No validation ran, yet reward.png exists: its training-reward panel has data.
    assert pngs == sorted(f"{name}.png" for name in FIGURES)
    assert all((out / "plots" / name).stat().st_size > 10_000 for name in pngs)
