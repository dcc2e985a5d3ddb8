"""The colocated training loop every rank runs: one readable step, phases named and timed.

    prompts -> experience (weight sync, rollout, reward) -> old logp -> ref logp -> values
            -> advantages -> update (critic, actor) -> metrics, validation, checkpoint, plots

Every rank runs exactly this code on its own share of the batch (docs/design.md), holding both sides of a
run (``spmdrl.run.build.ColocatedRun``): the rollout engine takes the actor's weights straight from it,
and the two take turns on the device. Components are built by name from the config
(``spmdrl.run.build``); nothing below branches on a backend. Experience (generation and scoring, DAPO's
rounds, ReMax's baseline) is produced below the loop by ``spmdrl.experience``, which validation shares;
what the training side does with a scored batch is ``spmdrl.run.learn``, which split placement's
training ranks share (``spmdrl/split/``); what every run does around its steps (output folder,
checkpoints, preemption, plots) is ``spmdrl.run.upkeep``.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from spmdrl.checkpoint.preemption import Preemption
from spmdrl.checkpoint.rng import RNGState
from spmdrl.config import Config
from spmdrl.parallel import ParallelDims
from spmdrl.plan import Plan
from spmdrl.run.build import ColocatedRun, build
from spmdrl.run.learn import finish_step, learn
from spmdrl.run.upkeep import StepEnd, checkpoints
from spmdrl.validation import validation_metrics


def run(cfg: Config, dims: ParallelDims, plan: Optional[Plan] = None) -> None:
    """A colocated run: build, resume, validate first when asked, then steps until the last one or a stop."""
    r = build(cfg, dims, plan)
    assert isinstance(r, ColocatedRun), type(r)  # split placement runs spmdrl.split.run_split
    preemption = Preemption()  # SIGTERM/SIGUSR1 from here on: checkpoint and stop at the next step boundary
    tr, exp = r.training, r.experience
    # What a checkpoint holds; each part declares how it is stored (spmdrl/checkpoint/manager.py).
    rng = RNGState(exp.session.engine, r.device, cfg.trainer.seed)
    ckpt = checkpoints(r, {"actor": tr.actor, "critic": tr.critic, "data": r.train_loader,
                           "kl_ctrl": tr.kl_ctrl, "rng": rng})
    resumed = ckpt.resume() is not None  # trainer.resume: auto | off | PATH
    if resumed:
        r.step = ckpt.resumed_step
        exp.session.actor_changed()  # the rollout engine still holds the initial weights
    sink = r.open_output(resumed)
    end = StepEnd(r, sink, ckpt, preemption, r.timer)
    try:
        if r.validation.first(r.step):  # trainer.val_only / val_before_train
            sink.log(r.step, validation_metrics(exp, r.val_loader))
        r.timer.restart()  # the first step's window starts here
        going = not cfg.trainer.val_only
        while going and r.step < r.total_steps:
            going = step(r, end)
    finally:
        sink.close()
        r.close()
    dist.barrier()  # every rank is done with every collective; then the engine may tear down what it started
    exp.session.engine.close()


def step(r: ColocatedRun, end: StepEnd) -> bool:
    """One step on this rank's share of the batch, then its end (validation when due, metrics reduced,
    logging, checkpoint, figures); whether the run goes on."""
    tr, exp, t, cfg = r.training, r.experience, r.timer, r.cfg
    if tr.offload:  # the memory plan's decision: optimizer state and gradients leave while rollout runs
        with t.phase("offload"):
            for engine in tr.trained:
                engine.offload()
    dump = r.out_dir / cfg.trainer.rollout_data_dir if cfg.trainer.rollout_data_dir else None
    batch, metrics = exp.step_batch(r.train_loader, r.step + 1, r.tokenizer, dump_to=dump)
    if tr.offload:
        with t.phase("onload"):
            for engine in tr.trained:
                engine.onload()
    learned, tokens = learn(r, tr, batch, bypass=cfg.algorithm.rollout_correction.bypass_mode)
    metrics.update(learned)
    exp.session.actor_changed()
    r.step += 1
    exp.warn_failures(r.step, r.rank)
    # The data's total_epochs can run out first when DAPO's extra rounds drew more batches.
    last = r.step == r.total_steps or r.train_loader.exhausted
    if r.validation.due(r.step, last):
        with t.phase("validation"):
            metrics.update(validation_metrics(exp, r.val_loader))
    return end(r.step, finish_step(r, metrics, tokens), last=last)

