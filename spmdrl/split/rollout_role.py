"""A split placement's rollout rank: generate and score each step's batch, send it to the training ranks,
load the weights they send back when the schedule says (``spmdrl.split.schedule``), validate when asked.

It saves nothing: its sampling is keyed per response, and the training ranks' checkpoint holds the batches
in flight and the loader's position after them, which they send at the start.
"""

from __future__ import annotations

import spmdrl.split.schedule as schedule
from spmdrl.checkpoint.preemption import Preemption
from spmdrl.errors import ConfigError
from spmdrl.metrics import reduce_metrics
from spmdrl.run.build import RolloutRun
from spmdrl.split.exchange import Exchange, Kind
from spmdrl.validation import ValidationRows, validation_rows

# Rollout-rank metrics that would collide with the training ranks' own (their step, phases and memory)
# travel under this prefix.
ROLLOUT_PREFIX = "rollout_ranks/"


def run_rollout(r: RolloutRun, ex: Exchange, preemption: Preemption) -> None:
    """A rollout rank's run, from the training ranks' start message to its last batch (and, after it, the
    weights still sent for validations until the training ranks stop it).

    ``sent`` is the last step whose batch the training ranks hold; ``version`` the update the engine's
    weights are (``async/weights_version``)."""
    t, s = r.timer, r.cfg.rollout.max_staleness
    kind, start = ex.recv_start()
    if kind is Kind.START_ERROR:  # the training ranks could not resume: the same sentence ends this rank
        raise (ConfigError if start["config_error"] else RuntimeError)(start["error"])
    if start["data"] is not None:
        r.train_loader.load_state_dict(start["data"])
    if start["val_only"]:  # trainer.val_only: validate the initial or the resumed (sent) weights, and end
        if start["weights_now"]:
            _load_weights(r, ex)  # sent with a validation request
        else:
            _validate(r, ex)
        return
    sent, last, version = start["sent"], start["last"], 0
    if r.validation.first(sent):
        _validate(r, ex)  # the initial weights, before the first batch (logged as step 0)
    first = schedule.first_weights(sent, s, last, start["weights_now"])
    if first is not None:
        version = first
        if not _load_weights(r, ex):
            return
    while not last:
        step = sent + 1
        dump = r.cfg.trainer.rollout_data_dir  # verl's generation dump, written by the first rollout rank
        batch, metrics = r.experience.step_batch(r.train_loader, step, r.tokenizer,
                                                 dump_to=r.out_dir / dump if dump else None)
        r.experience.warn_failures(step, r.rank)
        exhausted = r.train_loader.exhausted
        last = step == r.total_steps or exhausted
        metrics.update(t.pop())
        metrics = _prefixed(reduce_metrics(metrics, r.group))
        metrics["async/weights_version"] = float(version)
        # "exhausted": the data ran out, which a resume with another trainer.total_steps keeps as the end.
        info = {"step": step, "version": version, "last": last, "exhausted": exhausted, "metrics": metrics,
                "data": r.train_loader.state_dict(), "stop": preemption.signalled}
        with t.phase("send_batch"):  # under staleness 2+ in the background: the next batch starts at once
            ex.send_batch(batch, info, overlap=s >= 2)
        sent = step
        update = schedule.rollout_takes_weights(sent, s, last)
        if update is not None:  # the update the next batch is generated with
            version = update
            if not _load_weights(r, ex):
                return
    if schedule.rollout_waits_at_end(r.validation.during_training, s):
        while _load_weights(r, ex):
            pass
    ex.wait_batch_sent()


def _load_weights(r: RolloutRun, ex: Exchange) -> bool:
    """Receive the next weights (the engine loads them at its next batch) and validate them when asked.
    False: the training ranks stopped the run."""
    with r.timer.phase("wait_weights"):
        weights, validate = ex.recv_weights()
    if weights is None:
        return False
    # Once: the engine's load is their last use, so they are freed after it instead of being held through
    # the next batch (and next to the next weights as they arrive).
    pending = [weights]
    r.experience.session.actor_changed(lambda: iter(pending.pop()))
    if validate:
        _validate(r, ex)
    return True


def _validate(r: RolloutRun, ex: Exchange) -> None:
    """Validate the weights the engine holds and send the scored rows to the training ranks."""
    with r.timer.phase("validation"):
        rows = validation_rows(r.experience, r.val_loader) if r.val_loader is not None else ValidationRows()
        ex.send_validation(rows)


def _prefixed(metrics: dict[str, float]) -> dict[str, float]:
    """The rollout ranks' metrics as the training ranks log them: their timing and memory under
    ``rollout_ranks/`` (the training ranks have their own)."""
    return {(ROLLOUT_PREFIX + k if k.startswith(("timing/", "memory/", "perf/")) else k): v
            for k, v in metrics.items()}
