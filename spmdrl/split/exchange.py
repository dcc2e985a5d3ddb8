"""The hand-overs between split placement's two roles: every message, its kind, and how it travels.

A message is a JSON header that names its ``kind`` and describes its tensors, then the raw tensors, each
a broadcast from the sender over a group of its own (``ParallelDims.build``): nothing is pickled, and a
receiver that gets a kind it does not expect stops with a sentence saying which.

    kind          from -> to                                   group          carries
    start         training rank 0 -> rollout ranks            weights        where a (resumed) run stands
    start_error   training rank 0 -> rollout ranks            weights        the sentence that stops them
    bucket        training rank 0 -> rollout ranks            weights        a flat buffer of weights
    weights_end   training rank 0 -> rollout ranks            weights        whether to validate them
    stop          training rank 0 -> rollout ranks            weights        the run ends here
    batch         each rollout rank -> every training rank    batch{r}       its share of a step's batch
    ask           each rollout rank -> every training rank    batch{r}       rows for the reward model
    answer        training rank 0 -> that rollout rank        batch{r}       the model's scores of them
    validation    each rollout rank -> every training rank    batch{r}       its scored validation rows

The header travels as CPU tensors and the tensors on the rank's device: on CUDA the group's two backends
carry them (gloo, NCCL), and every rank puts a tensor on the same backend as the sender does.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from spmdrl.batch import Batch
from spmdrl.parallel import ParallelDims
from spmdrl.placement import own_groups
from spmdrl.rollout.base import buckets
from spmdrl.rollout.flat import flatten, unflatten
from spmdrl.validation import ValidationRows


class Kind(str, Enum):
    START = "start"
    START_ERROR = "start_error"
    BUCKET = "bucket"
    WEIGHTS_END = "weights_end"
    STOP = "stop"
    BATCH = "batch"
    ASK = "ask"
    ANSWER = "answer"
    VALIDATION = "validation"


Pending = list  # (work, tensor) pairs of broadcasts running in the background, to be waited for


def _broadcast_message(header: Optional[dict], tensors: Optional[list[torch.Tensor]], src: int,
                       group: dist.ProcessGroup, device: torch.device,
                       pending: Optional[Pending] = None) -> tuple[dict, list[torch.Tensor]]:
    """Broadcast one message from ``src`` over ``group``: the header as JSON bytes (length first), then each
    tensor its header describes ([dtype, shape] under "tensors"); returns it on every rank. ``pending`` (a
    sender's list): the broadcasts run in the background, in order; their (work, tensor) pairs go there
    (the tensors stay alive until waited for)."""
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
    assert header is not None and tensors is not None
    tensors = [t.to(device) for t in tensors]
    for t in tensors:
        broadcast(t)
    return header, tensors


def _send(kind: Kind, fields: dict[str, Any], tensors: list[torch.Tensor], src: int,
          group: dist.ProcessGroup, device: torch.device, pending: Optional[Pending] = None) -> None:
    header = {"kind": kind.value, **fields, "tensors": _described(tensors)}
    _broadcast_message(header, tensors, src, group, device, pending)


def _recv(src: int, group: dist.ProcessGroup, device: torch.device,
          expect: tuple[Kind, ...]) -> tuple[Kind, dict, list[torch.Tensor]]:
    header, tensors = _broadcast_message(None, None, src, group, device)
    kind = Kind(header["kind"])
    if kind not in expect:
        wanted = " or ".join(repr(k.value) for k in expect)
        raise RuntimeError(f"split placement: a {kind.value!r} message arrived where {wanted} was expected "
                           f"(the roles are out of step)")
    return kind, header, tensors


def _wait(pending: Pending) -> None:
    for work, _ in pending:
        work.wait()
    pending.clear()


def _described(tensors: Iterable[torch.Tensor]) -> list[list]:
    return [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]


class Exchange:
    """This rank's end of the hand-overs (collective on their groups; see the module's docstring)."""

    def __init__(self, dims: ParallelDims, rank: int, n: int, bucket_bytes: int = 512 << 20,
                 device: torch.device = torch.device("cpu")):
        self.dims, self.rank, self.n = dims, rank, n  # n: responses per prompt, kept together
        self.device = device  # where the tensors travel: NCCL's on CUDA (the headers go over gloo)
        self._weights_sending: Pending = []  # weight broadcasts still running (send_weights)
        self._batch_sending: Pending = []  # a batch's broadcasts still running (send_batch)
        self.bucket_bytes = bucket_bytes  # rollout.update_weights_bucket_megabytes: one broadcast each
        self.rollout_ranks = list(range(dims.train_ranks, dims.world_size))
        # (training ranks, reward.sources.scored_at_rollout) The reward model's scores of the rows the
        # rollout ranks ask about (each rank's reward_model_inputs, in rollout order; collective) -> [n]
        self.scorer: Optional[Callable[[list[dict[str, list]]], torch.Tensor]] = None

    # ---- batches, asks and validation rows: every rollout rank -> every training rank ---------------

    def send_batch(self, batch: Batch, info: dict[str, Any], overlap: bool = False) -> None:
        """(rollout rank) This rank's share of the step's batch, with ``info`` (JSON: step, weights version,
        whether it is the last, the loader's position after it, a stop signal, the rollout's metrics).
        ``overlap``: the broadcasts run in the background (the tensors stay alive until sent); the next
        batch waits for them (``wait_batch_sent``), so at most one batch is on its way."""
        self.wait_batch_sent()
        names = list(batch.tensors)
        tensors = [batch.tensors[k].contiguous() for k in names]
        _send(Kind.BATCH, {"names": names, "non_tensor": batch.non_tensor, "info": info}, tensors, self.rank,
              self.dims.group(f"batch{self.rank}"), self.device, self._batch_sending if overlap else None)

    def wait_batch_sent(self) -> None:
        """(rollout rank) Wait for a batch still being sent (``send_batch(overlap=True)``)."""
        _wait(self._batch_sending)

    def recv_batch(self) -> tuple[Batch, dict[str, Any]]:
        """(training rank) The step's whole batch, every rollout rank's share in rollout order, and the first
        rollout rank's ``info`` (its ``stop``: whether any rollout rank was signalled)."""
        parts, infos = [], []
        for header, tensors in self._from_rollout_ranks(Kind.BATCH):
            parts.append(Batch(dict(zip(header["names"], tensors)), header["non_tensor"]))
            infos.append(header["info"])
        return Batch.cat(parts), {**infos[0], "stop": any(i["stop"] for i in infos)}

    def send_validation(self, rows: ValidationRows) -> None:
        """(rollout ranks) This rank's scored validation rows (the training ranks make the metrics, after
        adding their reward model's scores)."""
        _send(Kind.VALIDATION, {"rows": rows.to_json()}, [], self.rank, self.dims.group(f"batch{self.rank}"),
              self.device)

    def recv_validation(self) -> ValidationRows:
        """(training ranks) Every rollout rank's validation rows, in rollout order."""
        return ValidationRows.cat([header["rows"] for header, _ in self._from_rollout_ranks(Kind.VALIDATION)])

    def ask_scores(self, rows: dict[str, list]) -> torch.Tensor:
        """(rollout rank) The reward model's scores of ``rows`` (``reward_model_inputs``), asked of the
        training ranks (collective over the rollout ranks: ``_from_rollout_ranks``). -> [n] float32"""
        group = self.dims.group(f"batch{self.rank}")
        _send(Kind.ASK, {"rows": rows}, [], self.rank, group, self.device)
        return _recv(0, group, self.device, (Kind.ANSWER,))[2][0].cpu()

    def _from_rollout_ranks(self, kind: Kind) -> list[tuple[dict, list[torch.Tensor]]]:
        """(training ranks) The next ``kind`` message of every rollout rank, in rollout order, once the
        rollout ranks' asks for the reward model's scores that come before it are answered (they ask
        together: ``AskedModelReward`` is collective over the rollout ranks)."""
        while True:
            got = [_recv(src, self.dims.group(f"batch{src}"), self.device, (kind, Kind.ASK))
                   for src in self.rollout_ranks]
            kinds = {k for k, _, _ in got}
            if kinds == {kind}:
                return [(header, tensors) for _, header, tensors in got]
            if kinds != {Kind.ASK} or self.scorer is None:
                raise RuntimeError(f"split placement: rollout ranks asked for reward-model scores out of "
                                   f"step (some sent {kind.value!r} instead, or no reward model answers "
                                   f"here)")
            self._answer([header["rows"] for _, header, _ in got])

    def _answer(self, asks: list[dict[str, list]]) -> None:
        """(training ranks) Score every rollout rank's asked rows at once; training rank 0 answers each."""
        assert self.scorer is not None
        scores = self.scorer(asks)  # [all rows], every training rank
        start = 0
        for src, rows in zip(self.rollout_ranks, asks):
            n = len(rows["text"])
            answer = scores[start:start + n].contiguous()
            start += n
            group = self.dims.group(f"batch{src}")
            if self.rank == 0:
                _send(Kind.ANSWER, {}, [answer], 0, group, self.device)
            else:  # every training rank is in the group's broadcast
                _recv(0, group, self.device, (Kind.ANSWER,))

    def own_rows(self, batch: Batch, slot: int) -> Batch:
        """(training rank) This rank's rows of a whole batch: its block of each mini-batch slot of ``slot``
        prompts in global prompt order (``placement.own_groups``: the same global mini-batches at any number
        of rollout and training ranks), whole groups of n, the same number on every training rank so that
        the update's collectives line up (DAPO may keep a number of groups the training ranks do not divide:
        the last ones are dropped)."""
        return own_groups(batch, self.n, len(batch) // self.n, slot, self.rank, self.dims.train_ranks)

    # ---- training rank 0 -> every rollout rank: the start, the weights, a stop ----------------------

    def _control(self, kind: Kind, fields: dict[str, Any], pending: Optional[Pending] = None) -> None:
        """(training ranks) A message without tensors on the weights' group (rank 0 sends it); it goes
        after the weights still being sent."""
        if self.rank == 0:
            if pending is None:
                self.wait_weights_sent()
            _send(kind, fields, [], 0, self.dims.group("weights"), self.device, pending)

    def send_start(self, start: dict[str, Any]) -> None:
        """(training ranks) Where the run stands (``training_role.start``)."""
        self._control(Kind.START, start)

    def send_start_error(self, error: str, config_error: bool) -> None:
        """(training ranks) The run could not start (a resume failed): the same sentence ends the rollout
        ranks."""
        self._control(Kind.START_ERROR, {"error": error, "config_error": config_error})

    def send_stop(self) -> None:
        """(training ranks) The rollout ranks waiting for weights stop: the run ends."""
        self._control(Kind.STOP, {})

    def recv_start(self) -> tuple[Kind, dict[str, Any]]:
        """(rollout ranks) The start, or the sentence of a failed one."""
        kind, header, _ = _recv(0, self.dims.group("weights"), self.device, (Kind.START, Kind.START_ERROR))
        return kind, header

    def wait_weights_sent(self) -> None:
        """(training rank 0) Wait for the weights still being sent (``send_weights(overlap=True)``)."""
        _wait(self._weights_sending)

    def send_weights(self, named: Iterable[tuple[str, torch.Tensor]], validate: bool = False,
                     overlap: bool = False) -> None:
        """(training ranks) The actor's weights: every training rank runs the export (its gathers are
        collective over the training ranks), rank 0 sends them in buckets of about ``bucket_bytes``, each one
        flat byte buffer (one broadcast) described by its header, then their end. ``validate``: the rollout
        ranks validate these weights at once and send the metrics back (``recv_validation``). ``overlap``:
        the broadcasts run in the background (the update goes on meanwhile; the buckets stay in memory
        until they are sent) and the next message on the weights' group waits for them."""
        group = self.dims.group("weights")
        self.wait_weights_sent()
        pending = self._weights_sending if overlap else None
        for bucket in buckets(named, self.bucket_bytes):
            if self.rank == 0:
                flat, parts = flatten(bucket)
                _send(Kind.BUCKET, {"parts": parts}, [flat], 0, group, self.device, pending)
        self._control(Kind.WEIGHTS_END, {"validate": validate}, pending)

    def recv_weights(self) -> tuple[Optional[list[tuple[str, torch.Tensor]]], bool]:
        """(rollout rank) The weights training rank 0 sends, in the order the actor exports them (None when
        the training ranks stopped the run instead), and whether to validate them."""
        group, out = self.dims.group("weights"), list[tuple[str, torch.Tensor]]()
        while True:
            kind, header, tensors = _recv(0, group, self.device, (Kind.BUCKET, Kind.WEIGHTS_END, Kind.STOP))
            if kind is Kind.STOP:
                return None, False
            if kind is Kind.WEIGHTS_END:
                return out, header["validate"]
            out.extend(unflatten(tensors[0], header["parts"]))
