"""What every run does around its steps, written once for the RL run (colocated, and both roles of split
placement) and the SFT run:

    ckpt = checkpoints(run, parts)          # the parts that exist; collective over the ranks that save
    resumed = ckpt.resume() is not None     # trainer.resume: auto | off | PATH
    sink = open_output(run, resumed, ...)   # rank 0: an earlier run set aside, config.yaml, plan.json
    if run.validation.first(run.step): sink.log(run.step, <validation>)
    while ...:
        <the step>; if run.validation.due(step, last): <validation>
        go_on = end(step, metrics, last=last)   # log, preemption, checkpoint, plots, the closing warning

Each owner decides when it is due, as torchtitan's checkpointer and validator do: ``Validation.due`` (verl's
rule, the last-step rule a parameter), ``CheckpointManager.due``, ``StepEnd``'s plots. What a run's
validation *is* differs (rollouts and rewards for RL, an NLL for SFT, an exchange under split placement),
so the callers run it; when it runs is decided here.
"""

from __future__ import annotations

import json
import logging
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Optional, Protocol

from spmdrl.checkpoint.manager import CheckpointManager, Stateful
from spmdrl.checkpoint.preemption import Preemption
from spmdrl.checkpoint.run_folder import set_aside_earlier_run
from spmdrl.metrics import MetricsSink, PhaseTimer
from spmdrl.plot import plot_run

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger("spmdrl")


class RunFolder(Protocol):
    """What the setup reads of a run (an RL rank's ``RunCommon``, ``SFTRun``)."""

    cfg: Any  # Config or SFTConfig: both have .trainer and .model
    config_text: str
    rank: int
    out_dir: Path
    tokenizer: Any
    total_steps: int
    step: int


@dataclass(frozen=True)
class Validation:
    """When a run validates (verl's rules): before training (``trainer.val_before_train``, at step 0) or
    only (``trainer.val_only``); every ``trainer.test_freq`` steps; and at the last step, where the RL
    trainer validates only when test_freq > 0 and the SFT trainer always (``at_last_step``). Never
    without validation files."""

    freq: int  # trainer.test_freq (<= 0: not during training)
    before_train: bool
    only: bool
    at_last_step: bool  # also at the last step when freq <= 0 (SFT)
    available: bool  # data.val_files names files

    @classmethod
    def of(cls, trainer: Any, available: bool, *, at_last_step: bool = False) -> "Validation":
        return cls(trainer.test_freq, trainer.val_before_train, trainer.val_only, at_last_step, available)

    def first(self, step: int) -> bool:
        """Validate before the first step this process runs (step 0, or ``val_only``'s resumed weights)."""
        return self.available and (self.only or (self.before_train and step == 0))

    @property
    def during_training(self) -> bool:
        """Whether some step of the run validates."""
        return self.available and (self.freq > 0 or self.at_last_step)

    def due(self, step: int, last: bool) -> bool:
        """Whether ``step`` (the ``last`` one, or not) validates."""
        if not self.available:
            return False
        every = self.freq > 0 and step % self.freq == 0
        return every or (last and (self.freq > 0 or self.at_last_step))


def checkpoints(run: RunFolder, parts: dict[str, Optional[Stateful]],
                group: Optional["dist.ProcessGroup"] = None) -> CheckpointManager:
    """The run's checkpoint manager over the ``parts`` it has (None: a part this run lacks, e.g. no critic);
    ``group``: the ranks that save (default the world; split placement's training ranks)."""
    return CheckpointManager(run.out_dir, {k: v for k, v in parts.items() if v is not None}, cfg=run.cfg,
                             total_steps=run.total_steps, tokenizer=run.tokenizer,
                             config_text=run.config_text, group=group)


def open_output(run: RunFolder, resumed: bool, *, name: str, plan: Optional[dict] = None,
                also_set_aside: tuple[str, ...] = (), logged_config: Optional[dict] = None) -> MetricsSink:
    """The run folder on rank 0 (a fresh start sets an earlier run's files aside, never overwrites them;
    ``also_set_aside``: other folders of the run, such as a generation dump; config.yaml, and plan.json
    when there is a ``plan``) and the metrics sink of every rank (rank 0 writes; the loggers get
    ``logged_config``, by default the run's resolved config)."""
    if run.rank == 0:
        run.out_dir.mkdir(parents=True, exist_ok=True)
        if not resumed:
            set_aside_earlier_run(run.out_dir, also=also_set_aside)
        (run.out_dir / "config.yaml").write_text(run.config_text)
        if plan is not None:
            (run.out_dir / "plan.json").write_text(json.dumps(plan, indent=1) + "\n")
    t = run.cfg.trainer
    return MetricsSink(run.out_dir, t.logger, run.total_steps, rank=run.rank, progress_bar=t.progress_bar,
                       project=t.project_name, experiment=t.experiment_name,
                       config=asdict(run.cfg) if logged_config is None else logged_config,
                       initial_step=run.step, name=name)


class StepEnd:
    """The end of every step, in this order: log the metrics, hear a preemption (collective), checkpoint
    when due or stopping, plot when due; then say why the run ends, if it does. Under a ``timer`` each of
    these is a phase (of the next step's window)."""

    def __init__(self, run: RunFolder, sink: MetricsSink, ckpt: CheckpointManager, preemption: Preemption,
                 timer: Optional[PhaseTimer] = None) -> None:
        self.run, self.sink, self.ckpt, self.preemption, self.timer = run, sink, ckpt, preemption, timer
        self.stopped = False  # a preemption stopped the run (at the last call)

    def _phase(self, name: str) -> ContextManager[None]:
        return self.timer.phase(name) if self.timer is not None else nullcontext()

    def __call__(self, step: int, metrics: dict[str, float], *, last: bool, elsewhere: bool = False,
                 before_save: Optional[Callable[[], None]] = None) -> bool:
        """Close ``step`` (the ``last`` one, or not); whether the run goes on. ``elsewhere``: a rank outside
        the deciding group was signalled (split placement's rollout ranks); ``before_save``: what the run
        must hold before a checkpoint is written (split placement's batches in flight)."""
        with self._phase("log"):
            self.sink.log(step, metrics)
        # A preemption signal (SIGTERM/SIGUSR1) turns into a checkpoint at this step boundary, then exit.
        self.stopped = self.preemption.stop_requested(step, elsewhere=elsewhere)
        if self.ckpt.due(step, last) or self.stopped:
            with self._phase("checkpoint"):
                if before_save is not None:
                    before_save()
                self.ckpt.save(step)
        self._plot(step, final=last or self.stopped)
        if self.stopped:
            log.warning("stopping after step %d on a preemption signal; resume picks up from here", step)
            return False
        if last:
            self._warn_epochs_used(step)
            return False
        return True

    def _plot(self, step: int, final: bool) -> None:
        """Figures of metrics.jsonl into out_dir/plots every ``trainer.plot_freq`` steps and at the run's
        ``final`` step (rank 0; a failure only warns)."""
        f = self.run.cfg.trainer.plot_freq
        if self.run.rank == 0 and f > 0 and (step % f == 0 or final):
            with self._phase("plot"):
                plot_run(self.run.out_dir)

    def _warn_epochs_used(self, step: int) -> None:
        """The run ends before total_steps: the data's epochs ran out first (DAPO's extra rounds)."""
        if step < self.run.total_steps and self.run.rank == 0:
            log.warning("data.train_files' %d epoch(s) are used up after step %d of %d: dynamic sampling "
                        "drew extra generation batches (verl ends its epoch loop here too); set "
                        "trainer.total_steps to train on past the epochs", self.run.cfg.trainer.total_epochs,
                        step, self.run.total_steps)
