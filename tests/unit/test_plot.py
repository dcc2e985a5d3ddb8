"""spmdrl.plot renders real runs' metrics.jsonl into non-blank PNGs of the expected size.

``data/runs/{grpo_a,ppo_b}/metrics.jsonl`` were written by 4-step 2-rank runs of configs/grpo.yaml and
configs/ppo.yaml on the tiny model (validation with rollout.val_kwargs.n=2 every 2 steps; the PPO run also
before training).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from spmdrl.plot import DPI, FIGSIZE, FIGURES, main, plot_run, plot_runs, read_run

RUNS = Path(__file__).parent / "data" / "runs"


def _image(path: Path) -> np.ndarray:
    import matplotlib.image

    return matplotlib.image.imread(str(path))  # [H, W, 4] floats in [0, 1]


def _colored_pixels(img: np.ndarray) -> int:
    """Pixels of a data colour: axes, text and grid are grey, the lines and areas are coloured."""
    rgb = img[..., :3]
    return int(((rgb.max(-1) - rgb.min(-1)) > 0.25).sum())


def test_two_runs_overlay_into_six_nonblank_figures(tmp_path) -> None:
    written = plot_runs([RUNS / "grpo_a", RUNS / "ppo_b"], tmp_path)
    assert [p.name for p in written] == [f"{name}.png" for name in FIGURES]
    for png in written:
        img = _image(png)
        assert img.shape[:2] == (round(FIGSIZE[1] * DPI), round(FIGSIZE[0] * DPI)), png.name
        assert img[..., :3].var() > 1e-3, png.name  # not a blank canvas
        assert _colored_pixels(img) > 500, png.name  # data was drawn, not only axes


def test_one_run_timing_panel_takes_the_width_and_runs_merge_resumed_steps(tmp_path) -> None:
    run = tmp_path / "resumed"
    run.mkdir()
    rows = [json.loads(line) for line in (RUNS / "grpo_a" / "metrics.jsonl").read_text().splitlines()]
    # A run resumed from step 2 appends steps 3-4 again; the later rows win; a half-written last line is
    # skipped.
    redo = [{**row, "reward/mean": 0.5} for row in rows[2:]]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + redo)
                                       + '{"step": 5, "rew')
    loaded = read_run(run)
    steps, reward = loaded.series("reward/mean")
    assert steps == [1, 2, 3, 4] and reward[2:] == [0.5, 0.5]
    assert loaded.name == "resumed"
    written = plot_runs([run], tmp_path / "plots")
    timing = _image(tmp_path / "plots" / "timing.png")
    assert len(written) == len(FIGURES)
    assert timing.shape[:2] == (round(FIGSIZE[1] * DPI), round(FIGSIZE[0] * DPI))
    # The stacked areas fill the right half too (a 2-panel layout would leave it empty).
    assert _colored_pixels(timing[:, timing.shape[1] // 2:]) > 500


def test_missing_metrics_draw_nothing(tmp_path) -> None:
    run = tmp_path / "empty"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    assert plot_runs([run], tmp_path / "plots") == []


def test_cli_writes_into_the_run_folder_and_exits_2_on_a_missing_run(tmp_path, capsys) -> None:
    run = tmp_path / "grpo_a"
    shutil.copytree(RUNS / "grpo_a", run)
    main([str(run)])
    assert sorted(p.name for p in (run / "plots").iterdir()) == sorted(f"{name}.png" for name in FIGURES)
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "nowhere")])
    assert exit_info.value.code == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err


def test_training_hook_warns_instead_of_raising(tmp_path, caplog) -> None:
    assert plot_run(tmp_path / "no_such_run") == []
    assert "plotting" in caplog.text and "training goes on" in caplog.text


def test_an_sft_run_with_only_validation_rows_draws_its_validation_loss(tmp_path) -> None:
    """trainer.val_only (or a run stopped before step 1) logs val/loss and nothing else: the loss figure."""
    run = tmp_path / "val_only"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0, "val/loss": 2.5}\n{"step": 3, "val/loss": 2.25}\n')
    main([str(run)])
    pngs = sorted(p.name for p in (run / "plots").iterdir())
    assert pngs == ["loss.png"] and _colored_pixels(_image(run / "plots" / "loss.png")) > 0
