"""Split placement's schedule at ``rollout.max_staleness`` s: pure functions that both roles call, so the
two loops cannot drift apart on when weights move (tests/unit/test_split_schedule.py plays both roles
against each other without processes).

Batch k is generated with the weights of update k-1-s (the initial weights while that is below 1):

    s = 0   training: recv batch k | learn k | send weights k |            (the rollout waits for each update)
            rollout:  generate k | send k | recv weights k | generate k+1 ...
    s = 1   training: recv batch k | send weights k-1 | learn k | recv batch k+1 ...
            rollout:  generate k | send k | recv weights k-1 | generate k+1 (with update k-1) ...
    s >= 2  the rollout takes update j only after sending batch j+s, and sends its batches in the
            background, so it runs up to s batches ahead of the update

A step that validates under s >= 1 (and is not the last) sends its weights at once with the request; the
rollout ranks reach them after generating the next s batches, which the training ranks receive and hold
first (``validation_holds_ahead``); the next step then skips its own send of those same weights. A
checkpoint holds the s batches in flight the same way. At the end, rollout ranks that may still be
waiting for weights are told to stop.
"""

from __future__ import annotations

from typing import Optional


def weights_version(step: int, staleness: int) -> int:
    """The update whose weights generate batch ``step`` (0: the initial or resumed weights)."""
    return max(0, step - 1 - staleness)


# ---- the rollout ranks --------------------------------------------------------------------------------

def first_weights(sent: int, staleness: int, last: bool, weights_now: bool) -> Optional[int]:
    """(rollout ranks, at the start) The update whose weights arrive before the first batch they generate
    (None: they generate with the weights they hold). ``sent``: the batches the training ranks already hold
    (a resumed run's, those in its checkpoint); ``weights_now``: a resumed run sends its trained weights."""
    if last:
        return None
    if weights_now:
        return sent
    return rollout_takes_weights(sent, staleness, last)


def rollout_takes_weights(sent: int, staleness: int, last: bool) -> Optional[int]:
    """(rollout ranks) After sending batch ``sent`` (the ``last`` one, or not): the update whose weights they
    now wait for, which generates batch sent + 1 (None: the next batch uses the weights they hold)."""
    update = sent - staleness
    return update if not last and update >= 1 else None


def rollout_waits_at_end(validates: bool, staleness: int) -> bool:
    """(rollout ranks) After their last batch, whether weights still come (until the training ranks stop
    them): those of validations the training ranks ask for while they train on the batches in flight, and
    under s >= 2 updates sent before the last batch was trained on."""
    return validates or staleness >= 2


# ---- the training ranks -------------------------------------------------------------------------------

def sends_before_update(step: int, staleness: int, last: bool) -> bool:
    """(training ranks) Whether step ``step`` sends update step-1's weights before its own update
    (off-policy: the rollout generates batch step-1+s with them while this update runs)."""
    return staleness >= 1 and step >= 2 and not last


def sends_after_update(step: int, staleness: int, last: bool) -> bool:
    """(training ranks) Whether step ``step`` sends its update's weights after it (on-policy: the rollout
    waits for them to generate batch step+1)."""
    return staleness == 0 and not last


def validation_holds_ahead(staleness: int, last: bool) -> bool:
    """(training ranks) Whether a validation at this step sends the weights early, receiving and holding the
    next s batches the rollout generates before it reaches them (the next step then skips its send)."""
    return staleness >= 1 and not last


def validation_sends_weights(staleness: int, last: bool) -> bool:
    """(training ranks) Whether a validation sends the weights with its request itself (on-policy and not
    last, the step's own send carried the request)."""
    return last or validation_holds_ahead(staleness, last)


def batches_to_hold(staleness: int, held: int, last: bool, held_ends: bool) -> int:
    """(training ranks) How many more batches to receive and hold before a checkpoint or an early
    validation: the next s steps' (none past the last)."""
    return 0 if last or held_ends else max(0, staleness - held)


def drains_on_stop(staleness: int, last: bool, held_ends: bool, weights_sent_early: bool) -> bool:
    """(training ranks, stopping before the end) Whether the rollout ranks are generating a batch with
    weights they already hold (on-policy, or weights sent early with a validation request), which the
    training ranks take and drop so that no rollout rank waits for a receiver (a resumed run generates it
    again)."""
    return not (last or held_ends) and (staleness == 0 or weights_sent_early)


def tells_stop(validates: bool, rollout_done: bool, staleness: int) -> bool:
    """(training ranks, at the end) Whether rollout ranks may still wait for weights and must be told to
    stop: before their last batch (a preemption), while they wait for validations, or under s >= 2."""
    return not rollout_done or rollout_waits_at_end(validates, staleness)
