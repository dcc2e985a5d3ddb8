"""Split placement (``rollout.placement: split``): rollout ranks generate while training ranks update.

Still one program: a rank's role comes from its place in the world (``ParallelDims.trains`` /
``generates``), as a pipeline stage's does. With ``rollout.max_staleness`` 1 (one-step off-policy):

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
is pickled. Training rank 0 also starts the rollout ranks (where a resumed run stands) and stops them (a
preemption) on the weights' group. Where the rollout ranks need the training ranks' reward model as they
generate (DAPO's dynamic sampling, ReMax: ``reward.sources.scored_at_rollout``) they ask for its scores on
their batch groups, and the training ranks answer before taking the batch (``Exchange._recv_all``).

Checkpoints, preemption and resume are the training ranks' (``CheckpointManager`` on their group). A
checkpoint after step k holds the batches of steps k+1 .. k+s, which are in flight then (generated with
weights the checkpoint no longer holds), and the loader's position after them; a resumed run trains on
those batches first and the rollout ranks start past them, so it continues as the uninterrupted run does.
A SIGTERM/SIGUSR1 on a rollout rank reaches the training ranks with its next batch.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from spmdrl.batch import Batch, place_scores
from spmdrl.checkpoint.in_flight import InFlight
from spmdrl.checkpoint.manager import CheckpointManager
from spmdrl.checkpoint.preemption import Preemption
from spmdrl.checkpoint.rng import RNGState
from spmdrl.errors import ConfigError
from spmdrl.experience import batch_metrics
from spmdrl.loop import (
    Run,
    build,
    close,
    end,
    finish_step,
    learn,
    open_output,
    plot_due,
    warn_epochs_used,
    warn_failures,
)
from spmdrl.metrics import MetricsSink, reduce_metrics
from spmdrl.parallel import ParallelDims
from spmdrl.precision import resolve_dtype
from spmdrl.reward.sources import score_in_shares, scored_at_rollout
from spmdrl.rollout.base import buckets
from spmdrl.rollout.flat import flatten, unflatten
from spmdrl.rollout.generations import dump_generations
from spmdrl.validation import ValidationRows, validation_rows

if TYPE_CHECKING:
    from spmdrl.config import Config
    from spmdrl.plan import Plan

log = logging.getLogger("spmdrl")

# Rollout-rank metrics that would collide with the training ranks' own (their step, phases and memory)
# travel under this prefix.
ROLLOUT_PREFIX = "rollout_ranks/"


def _send(header: dict, tensors: list[torch.Tensor], src: int, group: dist.ProcessGroup,
          device: torch.device, pending: Optional[list] = None) -> None:
    _exchange(header, tensors, src, group, device, pending)


def _recv(src: int, group: dist.ProcessGroup, device: torch.device) -> tuple[dict, list[torch.Tensor]]:
    return _exchange(None, None, src, group, device)


def _exchange(header: Optional[dict], tensors: Optional[list[torch.Tensor]], src: int,
              group: dist.ProcessGroup, device: torch.device,
              pending: Optional[list] = None) -> tuple[dict, list[torch.Tensor]]:
    """Broadcast one message from ``src`` over ``group``: the header as JSON bytes (length first), then each
    tensor its header describes ([dtype, shape] under "tensors"); returns it on every rank.

    The header travels as CPU tensors and the tensors on ``device``: on CUDA the group's two backends
    carry them (gloo, NCCL), and every rank must put a tensor on the same backend as the sender does.
    ``pending`` (a sender's list): the broadcasts run in the background, in order; (work, tensor) pairs
    go there, to be waited for (the tensors stay alive until then)."""
    def broadcast(t: torch.Tensor) -> None:
        work = dist.broadcast(t, src, group=group, async_op=pending is not None)
        if pending is not None:
            pending.append((work, t))

    sending = header is not None
    # A list field the data gave as a type JSON lacks (a numpy scalar in extra_info) travels as its text.
    raw = json.dumps(header, default=str).encode() if sending else b""
    length = torch.tensor([len(raw)], dtype=torch.int64)
    broadcast(length)
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if sending else \
        torch.empty(int(length), dtype=torch.uint8)
    broadcast(buf)
    if not sending:
        header = json.loads(buf.numpy().tobytes())
        tensors = [torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                   for dtype, shape in header["tensors"]]
    tensors = [t.to(device) for t in tensors]
    for t in tensors:
        broadcast(t)
    return header, tensors


def _described(tensors: Iterable[torch.Tensor]) -> list[list]:
    return [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]


class Exchange:
    """The hand-overs between the roles (collective on their groups; see the module's docstring)."""

    def __init__(self, dims: ParallelDims, rank: int, n: int, bucket_bytes: int = 512 << 20,
                 device: torch.device = torch.device("cpu")):
        self.dims, self.rank, self.n = dims, rank, n  # n: responses per prompt, kept together
        self.device = device  # where the tensors travel: NCCL's on CUDA (the headers go over gloo)
        self._in_flight: list = []  # (work, tensor) of weight broadcasts still running (send_weights)
        self._batch_in_flight: list = []  # (work, tensor) of a batch's broadcasts still running (send_batch)
        self.bucket_bytes = bucket_bytes  # rollout.update_weights_bucket_megabytes: one broadcast each
        self.rollout_ranks = list(range(dims.train_ranks, dims.world_size))
        # (training ranks, reward.sources.scored_at_rollout) The reward model's scores of the rows the
        # rollout ranks ask about (each rank's reward_model_inputs, in rollout order; collective) -> [n]
        self.scorer: Optional[Callable[[list[dict[str, list]]], torch.Tensor]] = None

    # ---- batch: every rollout rank -> every training rank ------------------------------------------

    def send_batch(self, batch: Batch, info: dict[str, Any], overlap: bool = False) -> None:
        """(rollout rank) This rank's share of the step's batch, with ``info`` (JSON: step, weights version,
        whether it is the last, the loader's position after it, a stop signal, the rollout's metrics).
        ``overlap``: the broadcasts run in the background (the tensors stay alive until sent); the next
        batch waits for them (``settle_batches``), so at most one batch is on its way."""
        self.settle_batches()
        names = list(batch.tensors)
        tensors = [batch.tensors[k].contiguous() for k in names]
        header = {"names": names, "tensors": _described(tensors), "non_tensor": batch.non_tensor,
                  "info": info}
        _send(header, tensors, self.rank, self.dims.group(f"batch{self.rank}"), self.device,
              self._batch_in_flight if overlap else None)

    def settle_batches(self) -> None:
        """(rollout rank) Wait for a batch still being sent (``send_batch(overlap=True)``)."""
        for work, _ in self._batch_in_flight:
            work.wait()
        self._batch_in_flight = []

    def recv_batch(self) -> tuple[Batch, dict[str, Any]]:
        """(training rank) The step's whole batch, every rollout rank's share in rollout order, and the first
        rollout rank's ``info`` (its ``stop``: whether any rollout rank was signalled)."""
        parts, infos = [], []
        for header, tensors in self._recv_all():
            parts.append(Batch(dict(zip(header["names"], tensors)), header["non_tensor"]))
            infos.append(header["info"])
        return Batch.cat(parts), {**infos[0], "stop": any(i["stop"] for i in infos)}

    def _recv_all(self) -> list[tuple[dict, list[torch.Tensor]]]:
        """(training ranks) The next message of every rollout rank, in rollout order, once their requests
        for the reward model's scores are answered (they ask together: ``AskedModelReward`` is collective
        over the rollout ranks)."""
        while True:
            got = [_recv(src, self.dims.group(f"batch{src}"), self.device) for src in self.rollout_ranks]
            asks = [header.get("ask") for header, _ in got]
            if all(a is None for a in asks):
                return got
            if any(a is None for a in asks) or self.scorer is None:
                raise RuntimeError("split placement: rollout ranks asked for reward-model scores out of step "
                                   "(some sent a batch instead, or no reward model answers here)")
            scores = self.scorer(asks)  # [all rows], every training rank
            start = 0
            for src, rows in zip(self.rollout_ranks, asks):
                n = len(rows["text"])
                answer = scores[start:start + n].contiguous()
                start += n
                if self.rank == 0:
                    _send({"tensors": _described([answer])}, [answer], 0, self.dims.group(f"batch{src}"),
                          self.device)
                else:  # every training rank is in the group's broadcast
                    _recv(0, self.dims.group(f"batch{src}"), self.device)

    def ask_scores(self, rows: dict[str, list]) -> torch.Tensor:
        """(rollout rank) The reward model's scores of ``rows`` (``reward_model_inputs``), asked of the
        training ranks (collective over the rollout ranks: ``_recv_all``). -> [n] float32"""
        group = self.dims.group(f"batch{self.rank}")
        _send({"ask": rows, "tensors": []}, [], self.rank, group, self.device)
        return _recv(0, group, self.device)[1][0].cpu()

    def own_rows(self, batch: Batch) -> Batch:
        """(training rank) This rank's contiguous slice of a whole batch's rows: whole groups of n, the same
        number on every training rank so that the update's collectives line up (DAPO may keep a number of
        groups the training ranks do not divide: the rest is dropped)."""
        rows = len(batch) // self.n // self.dims.train_ranks * self.n
        return batch.select(slice(self.rank * rows, (self.rank + 1) * rows))

    # ---- training rank 0 -> every rollout rank: how to start, the weights, a stop ------------------

    def send_control(self, header: dict[str, Any], pending: Optional[list] = None) -> None:
        """(training ranks) A message without tensors: the start (where a resumed run stands), the end of the
        weights, or a stop."""
        if self.rank == 0:
            if pending is None:
                self.settle()
            _send({**header, "name": None, "tensors": []}, [], 0, self.dims.group("weights"), self.device,
                  pending)

    def settle(self) -> None:
        """(training rank 0) Wait for the weights still being sent (``send_weights(overlap=True)``)."""
        for work, _ in self._in_flight:
            work.wait()
        self._in_flight = []

    def recv_control(self) -> dict[str, Any]:
        return _recv(0, self.dims.group("weights"), self.device)[0]

    def send_weights(self, named: Iterable[tuple[str, torch.Tensor]], validate: bool = False,
                     overlap: bool = False) -> None:
        """(training ranks) The actor's weights: every training rank runs the export (its gathers are
        collective over the training ranks), rank 0 sends them in buckets of about ``bucket_bytes``, each one
        flat byte buffer (one broadcast) described by its header. ``validate``: the rollout ranks validate
        these weights at once and send the metrics back (``recv_validation``). ``overlap``: the broadcasts
        run in the background (the update goes on meanwhile; the buckets stay in memory until they are
        sent) and the next message on the weights' group waits for them (``settle``)."""
        group = self.dims.group("weights")
        self.settle()
        pending = self._in_flight if overlap else None
        for bucket in buckets(named, self.bucket_bytes):
            if self.rank == 0:
                flat, parts = flatten(bucket)
                _send({"name": "bucket", "parts": parts, "tensors": _described([flat])}, [flat], 0, group,
                      self.device, pending)
        self.send_control({"validate": validate}, pending)  # the end of the weights

    def recv_weights(self) -> tuple[Optional[list[tuple[str, torch.Tensor]]], bool]:
        """(rollout rank) The weights training rank 0 sends, in the order the actor exports them (None when
        the training ranks stopped the run instead), and whether to validate them."""
        group, out = self.dims.group("weights"), []
        while True:
            header, tensors = _recv(0, group, self.device)
            if header.get("stop"):
                return None, False
            if header["name"] is None:
                return out, header["validate"]
            out.extend(unflatten(tensors[0], header["parts"]))

    # ---- validation rows: every rollout rank -> every training rank ---------------------------------

    def send_validation(self, rows: ValidationRows) -> None:
        """(rollout ranks) This rank's scored validation rows (the training ranks make the metrics, after
        adding their reward model's scores)."""
        _send({"validation": rows.to_json(), "tensors": []}, [], self.rank,
              self.dims.group(f"batch{self.rank}"), self.device)

    def recv_validation(self) -> ValidationRows:
        """(training ranks) Every rollout rank's validation rows, in rollout order."""
        return ValidationRows.cat([header["validation"] for header, _ in self._recv_all()])


def _prefixed(metrics: dict[str, float]) -> dict[str, float]:
    """The rollout ranks' metrics as the training ranks log them: their timing and memory under
    ``rollout_ranks/`` (the training ranks have their own)."""
    return {(ROLLOUT_PREFIX + k if k.startswith(("timing/", "memory/", "perf/")) else k): v
            for k, v in metrics.items()}


def validates(r: Run) -> bool:
    """Whether the run validates during training (``trainer.test_freq`` and validation files); both roles
    decide alike."""
    return r.cfg.trainer.test_freq > 0 and r.val_loader is not None


def _validate(r: Run, ex: Exchange) -> None:
    """(rollout ranks) Validate the weights the engine holds and send the metrics to the training ranks."""
    with r.timer.phase("validation"):
        rows = validation_rows(r.experience, r.val_loader) if r.val_loader is not None else ValidationRows()
        ex.send_validation(rows)


def _validation_metrics(r: Run, ex: Exchange) -> dict[str, float]:
    """(training ranks) The metrics of the rollout ranks' validation rows, a reward model's scores added."""
    rows = ex.recv_validation()
    if rows.model_inputs is not None and rows.uids:  # (none when the rollout ranks asked for the scores)
        rows.add_model_scores(r.rewards, r.dims.group("train_cpu"))
    return rows.metrics(None)  # every training rank has every row


def _score(r: Run, batch: Batch) -> dict[str, float]:
    """(training ranks) Add the reward model's weighted score to each row's (the rollout ranks sent the sum
    of the other sources) and return the reward metrics of the sum; nothing without a reward model, or
    when the rollout ranks asked for its scores (the batch came scored whole: ``scored_at_rollout``)."""
    if r.rewards is None or scored_at_rollout(r.cfg):
        return {}
    with r.timer.phase("reward"):
        result = r.rewards(batch)
    batch["scores"] = batch["scores"] + result.scores.to(batch["scores"].device)  # [N]
    batch["token_rewards"] = place_scores(batch["scores"], batch["response_mask"])  # [N, R]
    return {**result.metrics, **{k: v for k, v in batch_metrics(batch).items() if k.startswith("reward/")}}


def _model_scores(r: Run, asks: list[dict[str, list]]) -> torch.Tensor:
    """(training ranks, collective) The reward model's scores (unweighted: the rollout ranks weigh them) of
    every row the rollout ranks asked about, in rollout order; each training rank scores a contiguous share.
    -> [n] float32"""
    rows = {key: [v for ask in asks for v in ask[key]] for key in asks[0]}
    model = next(source for source in r.rewards.sources if source.name == "rm")
    with r.timer.phase("reward"):  # inside the wait for the batch (or validation rows) it precedes
        return score_in_shares(lambda share, texts: model(share, texts).scores, rows,
                               r.dims.group("train_cpu"))


def _load_weights(r: Run, ex: Exchange) -> bool:
    """(rollout rank) Receive the next weights (the engine loads them at its next batch) and validate them
    when asked. False: the training ranks stopped the run."""
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


def rollout_ranks_loop(r: Run, ex: Exchange, preemption: Preemption) -> None:
    """A rollout rank's run: generate and score each step's batch, send it, load the weights sent back.

    ``sent`` is the last step whose batch the training ranks hold (a resumed run's checkpoint holds the
    batch in flight, so it starts past it); after sending batch ``sent`` the rollout waits for the weights
    of update ``sent - max_staleness``, which the training ranks send at the matching point of their loop."""
    t, s = r.timer, r.cfg.rollout.max_staleness
    start = ex.recv_control()
    if "error" in start:  # the training ranks could not resume: the same sentence ends this rank
        raise (ConfigError if start["config_error"] else RuntimeError)(start["error"])
    if start["data"] is not None:
        r.train_loader.load_state_dict(start["data"])
    if start["val_only"]:  # trainer.val_only: validate the initial or the resumed (sent) weights, and end
        if start["weights_now"]:
            _load_weights(r, ex)  # sent with a validation request
        else:
            _validate(r, ex)
        return
    sent, last, version = start["sent"], start["last"], 0  # version: the update the engine's weights are
    if sent == 0 and r.cfg.trainer.val_before_train and r.val_loader is not None:
        _validate(r, ex)  # the initial weights, before the first batch (logged as step 0)
    if not last and (start["weights_now"] or sent - s >= 1):
        version = sent if start["weights_now"] else sent - s
        if not _load_weights(r, ex):
            return
    while not last:
        step = sent + 1
        with t.phase("data"):
            prompts = next(r.train_loader)
        r.experience.step = step  # part of every sampling key: the same samples as a colocated run
        batch, metrics = r.experience.produce(prompts, more_prompts=r.train_loader)
        dump = r.cfg.trainer.rollout_data_dir
        if dump:  # verl's generation dump, written by the first rollout rank
            with t.phase("dump"):
                dump_generations(batch, r.tokenizer, step, r.out_dir / dump, r.group)
        metrics.update(batch_metrics(batch))
        warn_failures(r, step)
        last = step == r.total_steps or r.train_loader.exhausted
        metrics.update(t.pop())
        metrics = _prefixed(reduce_metrics(metrics, r.group))
        metrics["async/weights_version"] = float(version)
        info = {"step": step, "version": version, "last": last, "metrics": metrics,
                "data": r.train_loader.state_dict(), "stop": preemption.signalled}
        with t.phase("send_batch"):  # under staleness 2+ in the background: the next batch starts at once
            ex.send_batch(batch, info, overlap=s >= 2)
        sent = step
        if not last and sent - s >= 1:  # the update the next batch is generated with
            version = sent - s
            if not _load_weights(r, ex):
                return
    # The last batch is sent; the final weights (and those of a validation the training ranks ask for
    # while they train on the batch in flight) still come to be validated, until the training ranks stop us.
    # Under staleness 2+ weights sent before the last batch was trained on come too.
    while (validates(r) or s >= 2) and _load_weights(r, ex):
        pass
    ex.settle_batches()


def _next_batch(r: Run, ex: Exchange, held: InFlight) -> tuple[Batch, dict[str, Any]]:
    """(training rank) The next step's whole batch: the first one held (by a checkpoint, or received ahead),
    or the rollout's next."""
    batch, info = held.take() or _receive(r, ex)
    return batch.to(ex.device), info  # a held batch waits on the CPU


def _receive(r: Run, ex: Exchange) -> tuple[Batch, dict[str, Any]]:
    """(training rank) The rollout's next batch; the data part of a checkpoint follows the rollout's loader
    (it saves the position after the last batch received)."""
    batch, info = ex.recv_batch()
    r.train_loader.load_state_dict(info["data"])
    return batch, info


def _hold_ahead(r: Run, ex: Exchange, held: InFlight, last: bool) -> None:
    """(training ranks) Receive and hold the batches the rollout ranks generate before they take the weights
    of the update just made: the next ``max_staleness`` steps' (up to the last one). A checkpoint saves them
    (they were generated with weights it no longer holds); a validation request waits behind them."""
    while not last and len(held) < r.cfg.rollout.max_staleness and not held.ends:
        batch, info = _receive(r, ex)
        held.hold(batch.to(torch.device("cpu")), info)  # as a checkpoint's batches are read back


def _send_weights(r: Run, ex: Exchange, validate: bool = False, overlap: bool = False) -> None:
    with r.timer.phase("weight_send"):  # the export; with overlap, not the transfer that follows it
        ex.send_weights(r.actor.export_weights(resolve_dtype(r.cfg.rollout.dtype, r.device.type)), validate,
                        overlap)


def _validation(r: Run, ex: Exchange, held: InFlight, last: bool) -> tuple[dict[str, float], bool]:
    """(training ranks) Validate the weights of the update just made, on the rollout ranks: send them with a
    request and wait for the metrics. Under staleness s >= 1 the rollout ranks take weights only after their
    next s batches, which are then held (trained in the next steps, as always); returns (the metrics,
    whether these weights went out ahead of the point where the next step would send them)."""
    early = False
    with r.timer.phase("validation"):
        if not last and r.cfg.rollout.max_staleness >= 1:
            _hold_ahead(r, ex, held, last)
            early = True
        if last or early:  # under staleness 0 the step's weights went out with the request already
            _send_weights(r, ex, validate=True)
        return _validation_metrics(r, ex), early


def _drain(r: Run, ex: Exchange, held: InFlight, last: bool, early: bool) -> bool:
    """(training ranks, stopping before the end) The batch the rollout ranks are generating with weights
    they already hold (staleness 0, or weights sent early with a validation request), taken and dropped so
    that no rollout rank waits for a receiver or for the reward model's answers to its asks (the checkpoint
    is saved: a resumed run generates it again); whether it was their last."""
    if last or held.ends or not (r.cfg.rollout.max_staleness == 0 or early):
        return False
    with r.timer.phase("wait_rollout"):
        return ex.recv_batch()[1]["last"]


def _release(r: Run, ex: Exchange, rollout_done: bool) -> None:
    """(training ranks) The run ends here: rollout ranks still waiting for weights (a preemption before
    their last batch, or waiting for validations) are told to stop."""
    # Under staleness 2+ the rollout ranks may have sent their last batch before taking weights already
    # sent: they take weights until this stop.
    if validates(r) or not rollout_done or r.cfg.rollout.max_staleness >= 2:
        ex.send_control({"stop": True})
    ex.settle()


def train_ranks_loop(r: Run, ex: Exchange, sink: MetricsSink, ckpt: CheckpointManager, held: InFlight,
                     preemption: Preemption) -> bool:
    """A training rank's run: receive each step's batch, send the weights the rollout needs next, learn;
    checkpoints hold the batch in flight (``held``), which a resumed run trains on first. Returns whether
    the rollout ranks sent their last batch."""
    cfg, t = r.cfg, r.timer
    s, f = cfg.rollout.max_staleness, cfg.trainer.test_freq
    rc = cfg.algorithm.rollout_correction
    # Off-policy batches take the rollout's log-probs as the old ones unless a correction recomputes them,
    # or the rollout does not return them (verl's default: the actor computes them, as its recipe does).
    bypass = rc.bypass_mode or (s > 0 and not rc.corrects and cfg.rollout.calculate_log_probs)
    early = False  # the last update's weights went out already, with a validation request (once)
    while r.step < r.total_steps:
        step = r.step + 1
        with t.phase("wait_rollout"):  # verl's wait_prev_gen
            whole, info = _next_batch(r, ex, held)
        last = info["last"]
        if s >= 1 and step >= 2 and not last:  # the rollout generates step + s with these weights
            if not early:  # (unless they went out with the last step's validation request)
                _send_weights(r, ex, overlap=True)  # sent while the update runs
            early = False
        batch = ex.own_rows(whole)
        scored = _score(r, batch)
        metrics, tokens = learn(r, batch, bypass=bypass)
        val = validates(r) and (step % f == 0 or last)
        if s == 0 and not last:
            _send_weights(r, ex, validate=val)
        if val:
            val_metrics, early = _validation(r, ex, held, last)
            metrics.update(val_metrics)
        metrics.update(info["metrics"])
        metrics.update(scored)  # the reward with the reward model's part, over the rows trained on
        metrics["async/staleness"] = float(step - 1 - info["version"])
        r.step = step
        metrics = finish_step(r, metrics, tokens)
        with t.phase("log"):
            sink.log(r.step, metrics)
        stop = preemption.stop_requested(step, elsewhere=info["stop"])
        if ckpt.due(step, last) or stop:
            with t.phase("checkpoint"):
                _hold_ahead(r, ex, held, last)  # the batches in flight: the checkpoint holds them
                ckpt.save(step)
        plot_due(r, last or stop)
        if stop:
            log.warning("stopping after step %d on a preemption signal; resume picks up from here", r.step)
            return last or held.ends or _drain(r, ex, held, last, early)
        if last:
            warn_epochs_used(r)
            return True
    return True


def _restore(ex: Exchange, ckpt: CheckpointManager) -> bool:
    """(training ranks) Restore ``trainer.resume``'s checkpoint; whether it resumed. A failure reaches the
    rollout ranks too (they wait for the start message)."""
    try:
        return ckpt.resume() is not None
    except Exception as err:
        ex.send_control({"error": str(err), "config_error": isinstance(err, ConfigError)})
        raise


def _start(r: Run, ex: Exchange, held: InFlight, resumed: bool) -> bool:
    """(training ranks) Tell the rollout ranks where the run stands (``rollout_ranks_loop``'s start), and
    send the resumed weights when they are to generate (or, under ``trainer.val_only``, validate) with them
    first; whether the rollout ranks have sent their last batch."""
    # The checkpoint's batches in flight are trained first; with none (the run's last step), the rollout
    # starts from the trained weights.
    last = held.ends if len(held) else r.step >= r.total_steps
    val_only = r.cfg.trainer.val_only
    weights_now = resumed and (val_only or (not len(held) and not last))
    ex.send_control({"sent": r.step + len(held), "last": last, "weights_now": weights_now,
                     "data": r.train_loader.state_dict() if resumed else None, "val_only": val_only})
    if weights_now:
        _send_weights(r, ex, validate=val_only)
    return last


def run_split(cfg: "Config", dims: ParallelDims, plan: Optional["Plan"] = None) -> None:
    """A split placement's run (``spmdrl.loop.run``'s counterpart): each rank builds its role's part and runs
    its role's loop; both end together, then the rollout ranks close their engines."""
    r = build(cfg, dims, plan)
    ex = Exchange(r.dims, r.rank, r.cfg.rollout.n, r.cfg.rollout.update_weights_bucket_megabytes << 20,
                  r.device)
    if scored_at_rollout(r.cfg):  # the rollout ranks ask the training ranks' reward model as they generate
        if r.experience is not None:
            r.experience.rewards.connect(ex.ask_scores)
        else:
            ex.scorer = lambda asks: _model_scores(r, asks)
    # SIGTERM/SIGUSR1: the training ranks decide, hearing of a rollout rank's signal with its next batch.
    preemption = Preemption(group=dims.group("train_cpu"))
    resumed = rollout_done = False
    if r.actor is not None:
        held = InFlight()
        # What a checkpoint holds: the colocated run's parts (the data position is the rollout's, sent with
        # each batch) and the batch in flight; the rollout ranks' sampling is keyed, so they save nothing.
        parts = {"actor": r.actor, "critic": r.critic, "data": r.train_loader, "kl_ctrl": r.kl_ctrl,
                 "rng": RNGState(None, r.device, cfg.trainer.seed), "in_flight": held}
        ckpt = CheckpointManager(r.out_dir, {k: v for k, v in parts.items() if v is not None}, cfg=r.cfg,
                                 total_steps=r.total_steps, tokenizer=r.tokenizer, config_text=r.config_text,
                                 group=dims.group("train_cpu"))
        resumed = _restore(ex, ckpt)
        r.step = ckpt.resumed_step
    # Rank 0 sets an earlier run's files aside before the rollout ranks start (they write generation dumps).
    sink = open_output(r, resumed)
    try:
        if r.experience is not None:
            r.timer.restart()
            rollout_ranks_loop(r, ex, preemption)
        else:
            rollout_done = _start(r, ex, held, resumed)
            first = not resumed and cfg.trainer.val_before_train and r.val_loader is not None
            if cfg.trainer.val_only or first:  # the rollout ranks validate the weights they start with
                sink.log(r.step, _validation_metrics(r, ex))
            r.timer.restart()
            if not cfg.trainer.val_only:
                rollout_done = train_ranks_loop(r, ex, sink, ckpt, held, preemption) or rollout_done
                _release(r, ex, rollout_done)
    finally:
        close(r, sink)
    end(r)
