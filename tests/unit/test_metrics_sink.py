"""MetricsSink's tensorboard and wandb plumbing that needs no training run (the e2e run is
tests/e2e/test_verl_cli.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from spmdrl.metrics import MetricsSink, _wandb_mode


def _scalars(folder: Path, key: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(key)}


def _sink(out: Path, initial_step: int = 0) -> MetricsSink:
    return MetricsSink(out, ["jsonl", "tensorboard"], 10, rank=0, progress_bar=False,
                       initial_step=initial_step)


def test_tensorboard_steps_are_on_disk_before_close_and_a_resume_replaces_later_steps(tmp_path: Path):
    sink = _sink(tmp_path)
    for step in (1, 2, 3):
        sink.log(step, {"reward/mean": step / 10})
    # Flushed at each step: a run killed now keeps its curves.
    assert _scalars(tmp_path / "tensorboard", "reward/mean") == pytest.approx({1: 0.1, 2: 0.2, 3: 0.3})
    sink.close()
    resumed = _sink(tmp_path, initial_step=1)  # resumed from the checkpoint of step 1: steps 2, 3 again
    resumed.log(2, {"reward/mean": 0.5})
    resumed.close()
    assert _scalars(tmp_path / "tensorboard", "reward/mean") == pytest.approx({1: 0.1, 2: 0.5})


def test_wandb_mode_without_a_key_is_offline(monkeypatch, tmp_path: Path):
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    assert _wandb_mode() == "offline"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert _wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert _wandb_mode() == "disabled"
    monkeypatch.delenv("WANDB_MODE")
    (tmp_path / ".netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert _wandb_mode() == "online"


@pytest.mark.parametrize("logger", ["wandb", "tensorboard"])
def test_a_logger_whose_package_is_missing_stops_before_any_work(logger, monkeypatch, capsys):
    import sys

    from spmdrl.train import main

    monkeypatch.setitem(sys.modules, logger, None)  # importlib.util.find_spec now reports it absent
    with pytest.raises(SystemExit) as exc:
        main(["--trainer.logger", f"[console,{logger}]"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert (f"trainer.logger has '{logger}' but the {logger} package is not installed; pip install {logger}"
            in err)


def test_the_progress_bar_names_what_runs(tmp_path: Path):
    """The bar said "grpo" for every algorithm and for SFT; the loops pass the estimator's name (or sft)."""
    sink = MetricsSink(tmp_path, ["jsonl"], 3, rank=0, progress_bar=True, name="remax")
    try:
        assert sink._bar.desc == "remax"
    finally:
        sink.close()
