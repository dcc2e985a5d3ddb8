"""What every run does around its steps (spmdrl/run/upkeep.py), without processes: when validation is due
(verl's rules: the RL trainer validates at the last step only with test_freq > 0, the SFT trainer
always), and the end of a step's order (log, preemption, checkpoint, plots, the closing warning)."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from spmdrl.run.upkeep import StepEnd, Validation


def _trainer(test_freq: int, before: bool = False, only: bool = False) -> SimpleNamespace:
    return SimpleNamespace(test_freq=test_freq, val_before_train=before, val_only=only)


@pytest.mark.parametrize("freq, sft, due", [
    (-1, False, []),  # RL with test_freq -1: never, not even at the last step
    (-1, True, [5]),  # SFT: always at the last step
    (2, False, [2, 4, 5]),
    (2, True, [2, 4, 5]),
    (5, False, [5]),
])
def test_validation_is_due_as_verl_decides(freq, sft, due):
    v = Validation.of(_trainer(freq), available=True, at_last_step=sft)
    assert [k for k in range(1, 6) if v.due(k, last=k == 5)] == due
    assert v.during_training == bool(due)
    none = Validation.of(_trainer(freq), available=False, at_last_step=sft)  # no validation files
    assert not any(none.due(k, last=k == 5) for k in range(1, 6)) and not none.during_training


def test_validation_before_training():
    assert Validation.of(_trainer(-1, before=True), True).first(0)
    assert not Validation.of(_trainer(-1, before=True), True).first(3)  # a resumed run
    assert Validation.of(_trainer(-1, only=True), True).first(3)  # val_only: the resumed weights
    assert not Validation.of(_trainer(-1, before=True), False).first(0)


class _Recorder:
    def __init__(self, events: list, stop_at: int = 0, save_freq: int = 2, total: int = 6):
        self.events, self.stop_at, self.save_freq, self.total = events, stop_at, save_freq, total

    def log(self, step, metrics):  # the sink
        self.events.append(("log", step))

    def stop_requested(self, step, elsewhere=False):  # preemption
        self.events.append(("stop?", step))
        return step == self.stop_at or elsewhere

    def due(self, step, last=False):  # the checkpoint manager
        return step % self.save_freq == 0 or step == self.total or last

    def save(self, step):
        self.events.append(("save", step))


def _end(events: list, tmp_path: Path, **kw) -> StepEnd:
    rec = _Recorder(events, **kw)
    run = SimpleNamespace(cfg=SimpleNamespace(trainer=SimpleNamespace(plot_freq=0, total_epochs=1)), rank=0,
                          out_dir=tmp_path, total_steps=rec.total)
    return StepEnd(run, rec, rec, rec)


def test_the_end_of_a_step_logs_hears_a_stop_then_checkpoints(tmp_path, caplog):
    events: list = []
    end = _end(events, tmp_path, stop_at=3)
    held = []
    assert end(1, {}, last=False) and events == [("log", 1), ("stop?", 1)]
    assert end(2, {}, last=False, before_save=lambda: held.append(2)) and events[-1] == ("save", 2)
    assert held == [2]  # what the checkpoint must hold comes first, only when it saves
    with caplog.at_level(logging.WARNING, logger="spmdrl"):
        assert not end(3, {}, last=False, before_save=lambda: held.append(3))  # stopped: a checkpoint
    assert end.stopped and events[-3:] == [("log", 3), ("stop?", 3), ("save", 3)] and held == [2, 3]
    assert "stopping after step 3 on a preemption signal" in caplog.text


def test_a_rank_elsewhere_stops_the_run_and_the_last_step_ends_it(tmp_path, caplog):
    events: list = []
    end = _end(events, tmp_path)
    assert not end(1, {}, last=False, elsewhere=True) and end.stopped and events[-1] == ("save", 1)
    with caplog.at_level(logging.WARNING, logger="spmdrl"):
        assert not end(4, {}, last=True) and not end.stopped
    # The data ran out before total_steps (DAPO's extra rounds): said once, with the numbers.
    assert "epoch(s) are used up after step 4 of 6" in caplog.text
