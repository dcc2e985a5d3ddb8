"""A split placement's training rank: receive each step's batch, send the weights the rollout needs next
(``spmdrl.split.schedule``), learn (``spmdrl.run.learn``, as the colocated loop does), then the step's end
(``spmdrl.run.upkeep.StepEnd``); checkpoints hold the batches in flight, which a resumed run trains on first.

The training ranks decide for the run: they restore the checkpoint and tell the rollout ranks where it
stands (``start``), hear of a rollout rank's preemption signal with its batch, and tell the rollout ranks
to stop at the end (``release``). Where the rollout ranks need the reward model's scores as they generate
they ask, and the training ranks answer whenever they wait for a batch or validation rows.
"""

from __future__ import annotations

from typing import Any

import torch

import spmdrl.split.schedule as schedule
from spmdrl.batch import Batch, add_scores
from spmdrl.checkpoint.in_flight import InFlight
from spmdrl.checkpoint.manager import CheckpointManager
from spmdrl.errors import ConfigError
from spmdrl.experience import batch_metrics
from spmdrl.placement import slot_prompts
from spmdrl.precision import resolve_dtype
from spmdrl.reward.sources import score_in_shares, scored_at_rollout
from spmdrl.run.build import TrainingRun
from spmdrl.run.learn import finish_step, learn
from spmdrl.run.upkeep import StepEnd
from spmdrl.split.exchange import Exchange


def restore(r: TrainingRun, ex: Exchange, ckpt: CheckpointManager, held: InFlight) -> bool:
    """Restore ``trainer.resume``'s checkpoint; whether it resumed. Its batches in flight are held against
    this run's ``trainer.total_steps`` (which may differ) and must have its ``rollout.max_staleness``. A
    failure reaches the rollout ranks too (they wait for the start message)."""
    try:
        path = ckpt.resume()
        if path is not None:
            held.check_staleness(path)
        held.retarget(r.total_steps)
    except Exception as err:
        ex.send_start_error(str(err), isinstance(err, ConfigError))
        raise
    r.step = ckpt.resumed_step
    return path is not None


def start(r: TrainingRun, ex: Exchange, held: InFlight, resumed: bool) -> bool:
    """Tell the rollout ranks where the run stands, and send the resumed weights when they are to generate
    (or, under ``trainer.val_only``, validate) with them first; whether the rollout ranks have sent their
    last batch."""
    # The checkpoint's batches in flight are trained first; with none (the run's last step), the rollout
    # starts from the trained weights.
    last = held.ends if len(held) else r.step >= r.total_steps
    val_only = r.cfg.trainer.val_only
    weights_now = resumed and (val_only or (not len(held) and not last))
    ex.send_start({"sent": r.step + len(held), "last": last, "weights_now": weights_now,
                   "data": r.train_loader.state_dict() if resumed else None, "val_only": val_only})
    if weights_now:
        _send_weights(r, ex, validate=val_only)
    return last


def run_training(r: TrainingRun, ex: Exchange, end: StepEnd, held: InFlight) -> bool:
    """The steps, until the last one or a stop; whether the rollout ranks sent their last batch."""
    cfg, t = r.cfg, r.timer
    s = cfg.rollout.max_staleness
    rc = cfg.algorithm.rollout_correction
    # Off-policy batches take the rollout's log-probs as the old ones unless a correction recomputes them,
    # or the rollout does not return them (verl's default: the actor computes them, as its recipe does).
    bypass = rc.bypass_mode or (s > 0 and not rc.corrects and cfg.rollout.calculate_log_probs)
    early = False  # the last update's weights went out already, with a validation request
    while r.step < r.total_steps:
        step = r.step + 1
        with t.phase("wait_rollout"):  # verl's wait_prev_gen
            whole, info = _next_batch(r, ex, held)
        last = info["last"]
        if schedule.sends_before_update(step, s, last):  # the rollout generates step + s with these weights
            if not early:  # (unless they went out with the last step's validation request)
                _send_weights(r, ex, overlap=True)  # sent while the update runs
            early = False
        batch = ex.own_rows(whole, slot_prompts(cfg))
        scored = _score(r, batch)
        metrics, tokens = learn(r, r.training, batch, bypass=bypass)
        validate = r.validation.due(step, last)
        if schedule.sends_after_update(step, s, last):
            _send_weights(r, ex, validate=validate)
        if validate:
            with r.timer.phase("validation"):
                early = schedule.validation_holds_ahead(s, last)
                if early:
                    _hold_ahead(r, ex, held, last)
                if schedule.validation_sends_weights(s, last):
                    _send_weights(r, ex, validate=True)
                metrics.update(validation_metrics(r, ex))
        metrics.update(info["metrics"])
        metrics.update(scored)  # the reward with the reward model's part, over the rows trained on
        metrics["async/staleness"] = float(step - 1 - info["version"])
        r.step = step
        # A checkpoint holds the batches in flight: they are received first.
        if not end(step, finish_step(r, metrics, tokens), last=last, elsewhere=info["stop"],
                   before_save=lambda: _hold_ahead(r, ex, held, last)):
            if end.stopped:
                return last or held.ends or _drain(r, ex, held, last, early)
            return True
    return True


def release(r: TrainingRun, ex: Exchange, rollout_done: bool) -> None:
    """The run ends here: rollout ranks that may still wait for weights (a preemption before their last
    batch, validations, staleness 2+) are told to stop."""
    if schedule.tells_stop(r.validation.during_training, rollout_done, r.cfg.rollout.max_staleness):
        ex.send_stop()
    ex.wait_weights_sent()


def validation_metrics(r: TrainingRun, ex: Exchange) -> dict[str, float]:
    """The metrics of the rollout ranks' validation rows, a reward model's scores added."""
    rows = ex.recv_validation()
    if rows.model_inputs is not None and rows.uids:  # (none when the rollout ranks asked for the scores)
        assert r.training.reward_model is not None
        rows.add_model_scores(r.training.reward_model, r.dims.group("train_cpu"))
    return rows.metrics(None)  # every training rank has every row


def model_scores(r: TrainingRun, asks: list[dict[str, list]]) -> torch.Tensor:
    """(collective) The reward model's scores (unweighted: the rollout ranks weigh them) of every row the
    rollout ranks asked about, in rollout order; each training rank scores a contiguous share. -> [n]"""
    rows = {key: [v for ask in asks for v in ask[key]] for key in asks[0]}
    assert r.training.reward_model is not None
    model = next(source for source in r.training.reward_model.sources if source.name == "rm")
    with r.timer.phase("reward"):  # inside the wait for the batch (or validation rows) it precedes
        return score_in_shares(lambda share, texts: model(share, texts).scores, rows,
                               r.dims.group("train_cpu"))


def _next_batch(r: TrainingRun, ex: Exchange, held: InFlight) -> tuple[Batch, dict[str, Any]]:
    """The next step's whole batch: the first one held (by a checkpoint, or received ahead), or the
    rollout's next."""
    batch, info = held.take() or _receive(r, ex)
    return batch.to(ex.device), info  # a held batch waits on the CPU


def _receive(r: TrainingRun, ex: Exchange) -> tuple[Batch, dict[str, Any]]:
    """The rollout's next batch; the data part of a checkpoint follows the rollout's loader (it saves the
    position after the last batch received)."""
    batch, info = ex.recv_batch()
    r.train_loader.load_state_dict(info["data"])
    return batch, info


def _hold_ahead(r: TrainingRun, ex: Exchange, held: InFlight, last: bool) -> None:
    """Receive and hold the batches the rollout ranks generate before they take the weights of the update
    just made: the next ``max_staleness`` steps' (up to the last one). A checkpoint saves them (they were
    generated with weights it no longer holds); a validation request waits behind them."""
    s = r.cfg.rollout.max_staleness
    while schedule.batches_to_hold(s, len(held), last, held.ends):
        batch, info = _receive(r, ex)
        held.hold(batch.to(torch.device("cpu")), info)  # as a checkpoint's batches are read back


def _send_weights(r: TrainingRun, ex: Exchange, validate: bool = False, overlap: bool = False) -> None:
    with r.timer.phase("weight_send"):  # the export; with overlap, not the transfer that follows it
        ex.send_weights(r.training.actor.export_weights(resolve_dtype(r.cfg.rollout.dtype, r.device.type)),
                        validate, overlap)


def _drain(r: TrainingRun, ex: Exchange, held: InFlight, last: bool, early: bool) -> bool:
    """(stopping before the end) The batch the rollout ranks are generating with weights they already hold,
    taken and dropped so that no rollout rank waits for a receiver or for the reward model's answers to its
    asks (the checkpoint is saved: a resumed run generates it again); whether it was their last."""
    if not schedule.drains_on_stop(r.cfg.rollout.max_staleness, last, held.ends, early):
        return False
    with r.timer.phase("wait_rollout"):
        return ex.recv_batch()[1]["last"]


def _score(r: TrainingRun, batch: Batch) -> dict[str, float]:
    """Add the reward model's weighted score to each row's (the rollout ranks sent the sum of the other
    sources) and return the reward metrics of the sum; nothing without a reward model, or when the rollout
    ranks asked for its scores (the batch came scored whole: ``scored_at_rollout``)."""
    rewards = r.training.reward_model
    if rewards is None or scored_at_rollout(r.cfg):
        return {}
    with r.timer.phase("reward"):
        result = rewards(batch)
    add_scores(batch, result.scores)
    return {**result.metrics, **{k: v for k, v in batch_metrics(batch).items() if k.startswith("reward/")}}
