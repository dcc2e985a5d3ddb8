"""Split placement (``rollout.placement: split``): rollout ranks generate while training ranks update.

Still one program: a rank's role comes from its place in the world (``ParallelDims.trains`` /
``generates``), as a pipeline stage's does. With ``rollout.max_staleness`` 1 (one-step off-policy):

    training ranks:  recv batch k | send weights k-1 | learn on batch k ............ | recv batch k+1 | ...
    rollout ranks:   generate batch k | send batch k | recv weights k-1 | generate batch k+1 | send ...

Batch k+1 is generated with the weights of update k-1 while the training ranks run update k, so a batch
is one update old when it is trained on (``async/staleness``), and the PPO ratio takes the rollout's own
log-probs as the old ones (verl's bypass mode) unless a rollout correction is asked for. With
``max_staleness`` 0 the rollout ranks wait for each update: the same samples and updates as a colocated
run, which is how a split run is checked.

The two roles meet only in these exchanges, in the same order on both sides (batch k, then weights), each
a broadcast on a group of its own (``ParallelDims.build``): every rollout rank sends its share of the
batch to every training rank, which keeps its own slice of the rows in rollout order; training rank 0
sends the weights, one tensor at a time as the actor exports them, to every rollout rank. A message is a
JSON header (names, dtypes, shapes, the batch's lists, the rollout's metrics) and then raw tensors: nothing
is pickled.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, Iterable, Optional

import torch
import torch.distributed as dist

from spmdrl.batch import Batch
from spmdrl.experience import batch_metrics
from spmdrl.loop import Run, build, close, end, finish_step, learn, open_output, warn_failures
from spmdrl.metrics import MetricsSink, reduce_metrics
from spmdrl.parallel import ParallelDims
from spmdrl.precision import resolve_dtype

if TYPE_CHECKING:
    from spmdrl.config import Config
    from spmdrl.plan import Plan

log = logging.getLogger("spmdrl")

# Rollout-rank metrics that would collide with the training ranks' own (their step, phases and memory)
# travel under this prefix.
ROLLOUT_PREFIX = "rollout_ranks/"


def _send(header: dict, tensors: list[torch.Tensor], src: int, group: dist.ProcessGroup) -> None:
    _exchange(header, tensors, src, group)


def _recv(src: int, group: dist.ProcessGroup) -> tuple[dict, list[torch.Tensor]]:
    return _exchange(None, None, src, group)


def _exchange(header: Optional[dict], tensors: Optional[list[torch.Tensor]], src: int,
              group: dist.ProcessGroup) -> tuple[dict, list[torch.Tensor]]:
    """Broadcast one message from ``src`` over ``group``: the header as JSON bytes (length first), then each
    tensor its header describes ([dtype, shape] under "tensors"); returns it on every rank."""
    sending = header is not None
    # A list field the data gave as a type JSON lacks (a numpy scalar in extra_info) travels as its text.
    raw = json.dumps(header, default=str).encode() if sending else b""
    length = torch.tensor([len(raw)], dtype=torch.int64)
    dist.broadcast(length, src, group=group)
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if sending else \
        torch.empty(int(length), dtype=torch.uint8)
    dist.broadcast(buf, src, group=group)
    if not sending:
        header = json.loads(buf.numpy().tobytes())
        tensors = [torch.empty(shape, dtype=getattr(torch, dtype)) for dtype, shape in header["tensors"]]
    for t in tensors:
        dist.broadcast(t, src, group=group)
    return header, tensors


def _described(tensors: Iterable[torch.Tensor]) -> list[list]:
    return [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]


class Exchange:
    """The two hand-overs between the roles (collective on their groups; see the module's docstring)."""

    def __init__(self, dims: ParallelDims, rank: int, n: int):
        self.dims, self.rank, self.n = dims, rank, n  # n: responses per prompt, kept together
        self.rollout_ranks = list(range(dims.train_ranks, dims.world_size))

    # ---- batch: every rollout rank -> every training rank ------------------------------------------

    def send_batch(self, batch: Batch, info: dict[str, Any]) -> None:
        """(rollout rank) This rank's share of the step's batch, with ``info`` (JSON: step, weights version,
        whether it is the last, the rollout's metrics)."""
        names = list(batch.tensors)
        tensors = [batch.tensors[k].contiguous() for k in names]
        header = {"names": names, "tensors": _described(tensors), "non_tensor": batch.non_tensor,
                  "info": info}
        _send(header, tensors, self.rank, self.dims.group(f"batch{self.rank}"))

    def recv_batch(self) -> tuple[Batch, dict[str, Any]]:
        """(training rank) The step's batch, this rank's contiguous slice of its rows in rollout order (whole
        groups of n: the config checks the sizes), and the first rollout rank's ``info``."""
        parts, info = [], None
        for src in self.rollout_ranks:
            header, tensors = _recv(src, self.dims.group(f"batch{src}"))
            parts.append(Batch(dict(zip(header["names"], tensors)), header["non_tensor"]))
            info = info or header["info"]
        batch = Batch.cat(parts)
        # Whole groups of n, the same number on every training rank so that the update's collectives line
        # up (DAPO may keep a number of groups the training ranks do not divide: the rest is dropped).
        rows = len(batch) // self.n // self.dims.train_ranks * self.n
        return batch.select(slice(self.rank * rows, (self.rank + 1) * rows)), info

    # ---- weights: training rank 0 -> every rollout rank --------------------------------------------

    def send_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """(training ranks) The actor's weights: every training rank runs the export (its gathers are
        collective over the training ranks), rank 0 sends each tensor as it comes."""
        group = self.dims.group("weights")
        for name, tensor in named:
            if self.rank == 0:
                _send({"name": name, "tensors": _described([tensor])}, [tensor.contiguous()], 0, group)
        if self.rank == 0:
            _send({"name": None, "tensors": []}, [], 0, group)

    def recv_weights(self) -> list[tuple[str, torch.Tensor]]:
        """(rollout rank) The weights training rank 0 sends, in the order the actor exports them."""
        group, out = self.dims.group("weights"), []
        while True:
            header, tensors = _recv(0, group)
            if header["name"] is None:
                return out
            out.append((header["name"], tensors[0]))


def _prefixed(metrics: dict[str, float]) -> dict[str, float]:
    """The rollout ranks' metrics as the training ranks log them: their timing and memory under
    ``rollout_ranks/`` (the training ranks have their own)."""
    return {(ROLLOUT_PREFIX + k if k.startswith(("timing/", "memory/", "perf/")) else k): v
            for k, v in metrics.items()}


def rollout_ranks_loop(r: Run, ex: Exchange) -> None:
    """A rollout rank's run: generate and score each step's batch, send it, load the weights sent back."""
    t, s = r.timer, r.cfg.rollout.max_staleness
    version = 0  # the update whose weights the engine holds (0: the initial weights)
    for step in range(r.step + 1, r.total_steps + 1):
        with t.phase("data"):
            prompts = next(r.train_loader)
        r.experience.step = step  # part of every sampling key: the same samples as a colocated run
        batch, metrics = r.experience.produce(prompts, more_prompts=r.train_loader)
        metrics.update(batch_metrics(batch))
        warn_failures(r, step)
        last = step == r.total_steps or r.train_loader.exhausted
        metrics.update(t.pop())
        metrics = _prefixed(reduce_metrics(metrics, r.group))
        metrics["async/weights_version"] = float(version)
        with t.phase("send_batch"):
            ex.send_batch(batch, {"step": step, "version": version, "last": last, "metrics": metrics})
        if last:
            return
        if step - s >= 1:  # the update the next batch is generated with (weights version step - s)
            with t.phase("wait_weights"):
                weights = ex.recv_weights()
            version = step - s
            r.experience.session.actor_changed(lambda w=weights: iter(w))


def train_ranks_loop(r: Run, ex: Exchange, sink: MetricsSink) -> None:
    """A training rank's run: receive each step's batch, send the weights the rollout needs next, learn."""
    cfg, t = r.cfg, r.timer
    s = cfg.rollout.max_staleness
    rc = cfg.algorithm.rollout_correction
    # Off-policy batches take the rollout's log-probs as the old ones unless a correction recomputes them.
    bypass = rc.bypass_mode or (s > 0 and not rc.corrects)
    dtype = resolve_dtype(cfg.rollout.dtype, r.device.type)
    while r.step < r.total_steps:
        step = r.step + 1
        with t.phase("wait_rollout"):  # verl's wait_prev_gen
            batch, info = ex.recv_batch()
        if s == 1 and step >= 2 and not info["last"]:  # the rollout generates step + 1 with these
            with t.phase("weight_send"):
                ex.send_weights(r.actor.export_weights(dtype))
        metrics, tokens = learn(r, batch, bypass=bypass)
        if s == 0 and not info["last"]:
            with t.phase("weight_send"):
                ex.send_weights(r.actor.export_weights(dtype))
        metrics.update(info["metrics"])
        metrics["async/staleness"] = float(step - 1 - info["version"])
        r.step = step
        metrics = finish_step(r, metrics, tokens)
        with t.phase("log"):
            sink.log(r.step, metrics)
        if info["last"]:
            if r.step < r.total_steps and r.rank == 0:
                log.warning("data.train_files' epochs are used up after step %d of %d", r.step, r.total_steps)
            return


def run_split(cfg: "Config", dims: ParallelDims, plan: Optional["Plan"] = None) -> None:
    """A split placement's run (``spmdrl.loop.run``'s counterpart): each rank builds its role's part and runs
    its role's loop; both end together, then the rollout ranks close their engines."""
    r = build(cfg, dims, plan)
    ex = Exchange(r.dims, r.rank, r.cfg.rollout.n)
    sink = open_output(r, resumed=False)  # split runs start fresh (the config refuses checkpoints for now)
    try:
        r.timer.restart()
        if r.experience is not None:
            rollout_ranks_loop(r, ex)
        else:
            train_ranks_loop(r, ex, sink)
    finally:
        close(r, sink)
    end(r)
