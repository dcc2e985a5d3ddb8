"""Split placement's schedule (spmdrl/split/schedule.py) played out without processes: both roles, as
``training_role.run_training`` and ``rollout_role.run_rollout`` call the schedule, run against each other
over two FIFO channels (training -> rollout: weights and stops; rollout -> training: batches and
validation rows). For staleness 0, 1 and 2, with validations and a stop, every batch must be generated
with the weights of update k-1-s, every validation must see the update just made, neither role may wait
for a message that never comes (a hang) and no message may be left unread (a sender that would wait
forever).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Generator, Optional

import pytest

import spmdrl.split.schedule as schedule


@dataclass
class Batch:
    step: int
    version: int  # the update whose weights generated it
    last: bool


@dataclass
class Weights:
    version: int
    validate: bool


@dataclass
class Rows:  # validation rows
    version: int


STOP = "stop"
Role = Generator[tuple, object, object]


def rollout(s: int, total: int, validates: bool, log: list) -> Role:
    """``rollout_role.run_rollout`` on a fresh start, one message at a time."""
    sent, last, version = 0, total == 0, 0

    def load():  # -> whether the run goes on
        nonlocal version
        got = yield ("recv", "weights")
        if got == STOP:
            return False
        version = got.version
        if got.validate:
            yield ("send", "batches", Rows(version))
        return True

    first = schedule.first_weights(sent, s, last, weights_now=False)
    if first is not None and not (yield from load()):
        return
    while not last:
        step = sent + 1
        last = step == total
        log.append(("generated", step, version))
        yield ("send", "batches", Batch(step, version, last))
        sent = step
        update = schedule.rollout_takes_weights(sent, s, last)
        if update is not None:
            if not (yield from load()):
                return
            assert version == update, (version, update)
    if schedule.rollout_waits_at_end(validates, s):
        while (yield from load()):
            pass


def training(s: int, total: int, freq: int, stop_at: Optional[int], log: list) -> Role:
    """``training_role.run_training`` and ``release``, one message at a time (``freq``: test_freq)."""
    held: deque[Batch] = deque()
    step_done, early = 0, False

    def receive():
        got = yield ("recv", "batches")
        assert isinstance(got, Batch), got
        return got

    def hold_ahead(last: bool):
        while schedule.batches_to_hold(s, len(held), last, bool(held) and held[-1].last):
            held.append((yield from receive()))

    def run():
        nonlocal step_done, early
        while step_done < total:
            step = step_done + 1
            batch = held.popleft() if held else (yield from receive())
            assert batch.step == step and batch.version == schedule.weights_version(step, s), (batch, step)
            last = batch.last
            log.append(("trained", step, batch.version))
            if schedule.sends_before_update(step, s, last):
                if not early:
                    yield ("send", "weights", Weights(step - 1, False))
                early = False
            validate = freq > 0 and (step % freq == 0 or last)  # Validation.due for RL
            if schedule.sends_after_update(step, s, last):
                yield ("send", "weights", Weights(step, validate))
            if validate:
                early = schedule.validation_holds_ahead(s, last)
                if early:
                    yield from hold_ahead(last)
                if schedule.validation_sends_weights(s, last):
                    yield ("send", "weights", Weights(step, True))
                rows = yield ("recv", "batches")
                assert rows == Rows(step), (rows, step)  # the update just made
                log.append(("validated", step))
            step_done = step
            if step == stop_at:
                yield from hold_ahead(last)  # the checkpoint holds the batches in flight
                held_ends = bool(held) and held[-1].last
                if last or held_ends:
                    return True
                if schedule.drains_on_stop(s, last, held_ends, early):
                    return (yield from receive()).last
                return False
            if last:
                return True
        return True

    rollout_done = yield from run()
    if schedule.tells_stop(freq > 0, rollout_done, s):
        yield ("send", "weights", STOP)


def play(s: int, total: int, freq: int = -1, stop_at: Optional[int] = None) -> list:
    """Both roles to their end; the log of what was generated, trained and validated."""
    log: list = []
    roles = {"training": training(s, total, freq, stop_at, log), "rollout": rollout(s, total, freq > 0, log)}
    channels: dict[str, deque] = {"weights": deque(), "batches": deque()}
    waiting: dict[str, Optional[tuple]] = {name: None for name in roles}
    answers: dict[str, object] = {name: None for name in roles}
    done: set[str] = set()
    while len(done) < 2:
        moved = False
        for name, role in roles.items():
            if name in done:
                continue
            want = waiting[name]
            if want is not None and want[0] == "recv":
                if not channels[want[1]]:
                    continue  # blocked on an empty channel
                answers[name] = channels[want[1]].popleft()
            try:
                want = role.send(answers[name]) if waiting[name] is not None else next(role)
            except StopIteration:
                done.add(name)
                moved = True
                continue
            answers[name] = None
            if want[0] == "send":
                channels[want[1]].append(want[2])
            waiting[name] = want
            moved = True
        assert moved, f"both roles wait: {waiting} (a hang)"
    assert not channels["weights"] and not channels["batches"], f"messages left unread: {channels}"
    return log


@pytest.mark.parametrize("s", [0, 1, 2])
def test_every_batch_is_generated_with_update_k_minus_1_minus_s(s):
    log = play(s, total=6)
    for event in ("generated", "trained"):
        assert [e for e in log if e[0] == event] == [(event, k, max(0, k - 1 - s)) for k in range(1, 7)]


@pytest.mark.parametrize("s", [0, 1, 2])
@pytest.mark.parametrize("freq", [1, 2, 4])
def test_validations_see_the_update_just_made_and_keep_the_schedule(s, freq):
    total = 5
    log = play(s, total, freq=freq)
    assert [e[1] for e in log if e[0] == "validated"] == [k for k in range(1, total + 1)
                                                          if k % freq == 0 or k == total]
    assert [e for e in log if e[0] == "trained"] == [("trained", k, max(0, k - 1 - s))
                                                     for k in range(1, total + 1)]


@pytest.mark.parametrize("s", [0, 1, 2])
@pytest.mark.parametrize("stop_at", [1, 2, 4, 5])
@pytest.mark.parametrize("freq", [-1, 2])
def test_a_stop_at_any_step_ends_both_roles_with_nothing_left_unread(s, stop_at, freq):
    log = play(s, total=5, freq=freq, stop_at=stop_at)
    assert [e[1] for e in log if e[0] == "trained"] == list(range(1, stop_at + 1))


def test_a_one_step_run_and_pure_functions():
    for s in (0, 1, 2):
        assert play(s, total=1, freq=1)[-1] == ("validated", 1)
    assert [schedule.weights_version(k, 1) for k in range(1, 5)] == [0, 0, 1, 2]
    assert schedule.first_weights(3, 1, last=False, weights_now=True) == 3  # a resumed run's weights
    assert schedule.first_weights(3, 1, last=True, weights_now=True) is None
    assert schedule.first_weights(3, 2, last=False, weights_now=False) == 1
