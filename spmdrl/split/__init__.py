"""Split placement (``rollout.placement: split``): rollout ranks generate while training ranks update.

Still one program: a rank's role comes from its place in the world (``ParallelDims.role``: a
``RankRole``), as a pipeline stage's does, and so does what it holds (``spmdrl.run.build``: a ``TrainingRun``
or a ``RolloutRun``). With ``rollout.max_staleness`` 1 (one-step off-policy):

    training ranks:  recv batch k | send weights k-1 | learn on batch k ............ | recv batch k+1 | ...
    rollout ranks:   generate batch k | send batch k | recv weights k-1 | generate batch k+1 | send ...

Batch k+1 is generated with the weights of update k-1 while the training ranks run update k, so a batch
is one update old when it is trained on (``async/staleness``), and the PPO ratio takes the rollout's own
log-probs as the old ones (verl's bypass mode) unless a rollout correction is asked for (or
``rollout.calculate_log_probs`` is false, verl's default: the actor computes them then). With
``max_staleness`` 0 the rollout ranks wait for each update: the same samples and updates as a colocated
run, which is how a split run is checked. With s >= 2 batch k is generated with the weights of update
k-1-s: the rollout ranks take update j only after sending batch j+s, and send their batches in the
background, so they run up to s batches ahead of the update.

The two roles meet only in these exchanges, in the same order on both sides (batch k, then weights), each
a broadcast on a group of its own (``ParallelDims.build``): every rollout rank sends its share of the
batch to every training rank, which keeps its own slice of the rows in rollout order; training rank 0
sends the weights in buckets (one flat buffer of ``rollout.update_weights_bucket_megabytes`` a
broadcast) as the actor exports them, to every rollout rank. A message is a
JSON header (names, dtypes, shapes, the batch's lists, the rollout's metrics) and then raw tensors: nothing
is pickled, and every message names its kind (``exchange.py``). Training rank 0 also starts the rollout
ranks (where a resumed run stands) and stops them (a preemption) on the weights' group. Where the rollout
ranks need the training ranks' reward model as they generate (DAPO's dynamic sampling, ReMax:
``reward.sources.scored_at_rollout``) they ask for its scores on their batch groups, and the training
ranks answer before taking the batch (``Exchange._from_rollout_ranks``).

Checkpoints, preemption and resume are the training ranks' (``CheckpointManager`` on their group). A
checkpoint after step k holds the batches of steps k+1 .. k+s, which are in flight then (generated with
weights the checkpoint no longer holds), and the loader's position after them; a resumed run trains on
those batches first and the rollout ranks start past them, so it continues as the uninterrupted run does.
A SIGTERM/SIGUSR1 on a rollout rank reaches the training ranks with its next batch.

    exchange.py       the messages and their kinds, how they travel
    schedule.py       when weights move, as pure functions both roles call
    training_role.py  a training rank's run
    rollout_role.py   a rollout rank's run
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch.distributed as dist

from spmdrl.checkpoint.in_flight import InFlight
from spmdrl.checkpoint.preemption import Preemption
from spmdrl.checkpoint.rng import RNGState
from spmdrl.parallel import ParallelDims
from spmdrl.reward.sources import scored_at_rollout
from spmdrl.run.build import RolloutRun, TrainingRun, build
from spmdrl.run.upkeep import StepEnd, checkpoints
from spmdrl.split import rollout_role, training_role
from spmdrl.split.exchange import Exchange

if TYPE_CHECKING:
    from spmdrl.config import Config
    from spmdrl.plan import Plan


def run_split(cfg: "Config", dims: ParallelDims, plan: Optional["Plan"] = None) -> None:
    """A split placement's run (``spmdrl.loop.run``'s counterpart): each rank builds its role's part and runs
    its role's loop; both end together, then the rollout ranks close their engines."""
    r = build(cfg, dims, plan)
    ex = Exchange(r.dims, r.rank, r.cfg.rollout.n, r.cfg.rollout.update_weights_bucket_megabytes << 20,
                  r.device)
    # SIGTERM/SIGUSR1: the training ranks decide, hearing of a rollout rank's signal with its next batch.
    preemption = Preemption(group=dims.group("train_cpu"))
    if isinstance(r, TrainingRun):
        _training(r, ex, preemption)
    else:
        assert isinstance(r, RolloutRun), type(r)
        _rollout(r, ex, preemption)


def _training(r: TrainingRun, ex: Exchange, preemption: Preemption) -> None:
    if scored_at_rollout(r.cfg):  # the rollout ranks ask this reward model as they generate
        ex.scorer = lambda asks: training_role.model_scores(r, asks)
    held = InFlight(r.cfg.rollout.max_staleness)
    tr = r.training
    # What a checkpoint holds: the colocated run's parts (the data position is the rollout's, sent with each
    # batch) and the batches in flight; the rollout ranks' sampling is keyed, so they save nothing.
    parts = {"actor": tr.actor, "critic": tr.critic, "data": r.train_loader, "kl_ctrl": tr.kl_ctrl,
             "rng": RNGState(None, r.device, r.cfg.trainer.seed), "in_flight": held}
    ckpt = checkpoints(r, parts, group=r.dims.group("train_cpu"))
    resumed = training_role.restore(r, ex, ckpt, held)
    # Rank 0 sets an earlier run's files aside before the rollout ranks start (they write generation dumps).
    sink = r.open_output(resumed)
    try:
        rollout_done = training_role.start(r, ex, held, resumed)
        if r.validation.first(r.step):  # the rollout ranks validate the weights they start with
            sink.log(r.step, training_role.validation_metrics(r, ex))
        r.timer.restart()
        if not r.cfg.trainer.val_only:
            end = StepEnd(r, sink, ckpt, preemption, r.timer)
            rollout_done = training_role.run_training(r, ex, end, held) or rollout_done
            training_role.release(r, ex, rollout_done)
    finally:
        sink.close()
        r.close()
    dist.barrier()  # every rank is done with every collective


def _rollout(r: RolloutRun, ex: Exchange, preemption: Preemption) -> None:
    if scored_at_rollout(r.cfg):  # ask the training ranks' reward model as this rank generates
        r.experience.rewards.connect(ex.ask_scores)
    sink = r.open_output(False)  # (only rank 0, a training rank, writes)
    try:
        r.timer.restart()
        rollout_role.run_rollout(r, ex, preemption)
    finally:
        sink.close()
        r.close()
    dist.barrier()  # every rank is done with every collective; then the engine may tear down what it started
    r.experience.session.engine.close()

