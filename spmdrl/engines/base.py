"""The training-engine interface the loop talks to, and the optimizer step written once for every backend.

An engine owns one sharded model (actor, reference, critic or reward model) and, when trained, its
optimizer. The loop never sees FSDP2 vs Megatron: it calls

    out = engine.forward_no_grad(batch, micro_batch_size)      # {"logp": [N, R], ...}
    metrics = engine.train_step(batch, loss_fn, mini_batch_size, micro_batch_size, epochs,
                                entropy_grad=False)
    for name, full_tensor in engine.export_weights(): ...    # HF names, one tensor at a time
    engine.offload(); engine.onload()                         # around rollout
    engine.state_dict(); engine.load_state_dict(sd)           # checkpoints (DCP)
    engine.dp_size, engine.dp_rank                            # its data-parallel coordinates

Each engine class is built by ``from_config(cfg, role, model_path=..., dims=..., device=...,
total_steps=...)`` with the run's ``ParallelDims``: an engine takes the meshes it needs from it
(FSDP2: the FSDP and TP meshes; Megatron: TP, PP and DP), so adding a parallel axis does not
change the factory. ``check_config(cfg)`` refuses what the engine cannot do before any work.

``train_step`` is written here once: epochs x mini-batches, each gathered over the model replica
(the ranks that hold different rows but run one forward: TP, or TP x PP), its ``LossScale``
all-reduced over the data-parallel groups, then the backend's hooks

    _forward_backward(micros, loss_fn, scale, ...)   # forward + backward of every micro-batch
    _finish_grads()                                  # cross-rank gradient sums the backward left out
    _clip_grads()                                    # global norm (before clipping), clipped in place

and the optimizer step (skipped on a non-finite norm), the schedule, and the loss metrics averaged
by ``_reduce_loss_metrics`` (by default over the data-parallel groups). A backend gives its groups
through ``dp_groups`` and ``_replica_group``; the gathers, row checks and counts are shared.

``loss_fn(outputs, micro_batch, scale) -> (loss, metrics)`` receives the
forward outputs of one micro-batch and a ``LossScale`` with the mini-batch's
global counts, so token-mean losses divide by the global number of valid
tokens and gradient accumulation and DP do not change the update.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Literal, Optional, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from spmdrl.algos.losses import loss_denominators
from spmdrl.algos.utils import Share
from spmdrl.batch import Batch
from spmdrl.engines.optim import move_optimizer_state, restore_settings
from spmdrl.errors import ConfigError

if TYPE_CHECKING:
    from spmdrl.config import Config
    from spmdrl.parallel import ParallelDims


@dataclass
class LossScale:
    """Global denominators of one mini-batch, all-reduced over the data-parallel group."""

    global_tokens: float  # valid response tokens in the mini-batch over all DP ranks
    global_seqs: float  # responses (rows, fully masked ones too: loss_denominators) over all DP ranks
    # No DP correction here: an engine whose gradient reduction averages (FSDP2) scales its own backward.


# Which model an engine holds (not a rank's role in the run: spmdrl.parallel.RankRole).
ModelRole = Literal["actor", "ref", "critic", "reward"]


# What an FSDP2 run adds to the process after its config is checked: torch.distributed, the transformers
# model classes, FSDP, and inductor's compiled RMSNorm/SwiGLU (measured on CPU: 0.30-0.34 GB).
FSDP2_RUNTIME_BYTES = 300 << 20


@dataclass(frozen=True)
class Layout:
    """How a backend lays one model out on a rank, for the memory plan (spmdrl/plan)."""

    shards: int  # ranks a model's weights and optimizer state are split over (FSDP x TP, or TP x PP)
    tp: int  # tensor parallelism: heads, MLP and the LM head's vocabulary are split this many ways
    layers_per_rank: int  # decoder layers on this rank (pipeline stages hold L / pp)
    gathers: bool  # FSDP: the root and the next layers are unsharded in the compute dtype during a forward
    runtime_bytes: float = 0.0  # what the backend adds to the process (imports, start-up) on CPU
    sp: int = 1  # sequence parallelism: a micro-batch's tokens are split this many ways (its rows are not)
LossFn = Callable[[dict[str, torch.Tensor], Batch, LossScale], tuple[torch.Tensor, dict[str, float]]]


class LogProbSource(Protocol):
    """What the loop asks of a reference policy: a ``TrainEngine``, or a LoRA actor with its adapters off."""

    def forward_no_grad(self, batch: Batch, micro_batch_size: int, with_entropy: bool = False,
                        max_token_len: Optional[int] = None) -> dict[str, torch.Tensor]: ...


def loss_metric_means(keys: list[str], totals: torch.Tensor, shares: set[str], n_mini: int
                      ) -> dict[str, float]:
    """From the sums over ranks ``totals`` [len(keys) + 1] (the last: micro-batches counted): a share's sum
    over the ``n_mini`` mini-batches (the same on every rank) divided by them, any other metric's by the
    micro-batches."""
    return {k: float(totals[i] / (n_mini if k in shares else totals[-1])) for i, k in enumerate(keys)}


class TrainEngine(abc.ABC):
    """One model on this rank's share of the training mesh; see the module docstring for the contract."""

    role: ModelRole
    model: nn.Module
    optimizer: Optional[torch.optim.Optimizer]  # None for a frozen engine (reference, reward model)
    scheduler: Optional[torch.optim.lr_scheduler.LambdaLR]  # with the optimizer
    device: torch.device
    strategy: str  # the backend's name (actor.strategy); checkpoints record it so export picks the reader
    checkpoint_layout = "sharded"  # a torch.distributed.checkpoint folder per engine (checkpoint/manager.py)
    max_grad_norm: float  # clip threshold (0: no clipping; the norm is reported either way)
    global_step: int  # optimizer steps taken, checkpointed

    @classmethod
    def check_config(cls, cfg: "Config") -> None:
        """Raise ValueError (one sentence) when ``cfg`` asks this engine for something it cannot do;
        runs before any process group or model exists. The default accepts everything."""

    @classmethod
    def join_as_bystander(cls, dims: "ParallelDims") -> None:
        """(a split placement's rollout ranks, which build no training engine) Take part in the collective
        steps of the training ranks' engine construction that span the whole world (torch makes a process
        group on every rank). The default: there are none (FSDP2's meshes are ``ParallelDims.build``'s)."""

    @classmethod
    def layout(cls, cfg: "Config", dims: "ParallelDims", layers: int) -> Layout:
        """How this backend lays a model of ``layers`` decoder layers out on one rank (the default: FSDP
        over the data-parallel shards times SP times TP, every layer on every rank)."""
        return Layout(shards=dims.dp_shard * dims.sp * dims.tp, tp=dims.tp, layers_per_rank=layers,
                      gathers=True, runtime_bytes=FSDP2_RUNTIME_BYTES, sp=dims.sp)

    @classmethod
    @abc.abstractmethod
    def from_config(
        cls,
        cfg: "Config",
        role: ModelRole,
        *,
        model_path: str,
        dims: "ParallelDims",
        device: torch.device | str,
        total_steps: int | None,
    ) -> "TrainEngine":
        """The ``role`` engine of this rank on the meshes of ``dims`` (collective: every rank calls it)."""

    @abc.abstractmethod
    def num_params(self) -> int:
        """Parameters of the full (unsharded) model; tied weights counted once."""

    # ------------------------------------------------------------------ data parallelism

    @property
    @abc.abstractmethod
    def dp_size(self) -> int:
        """Data-parallel replicas of the model (ranks holding different rows of one mini-batch)."""

    @property
    @abc.abstractmethod
    def dp_rank(self) -> int:
        """This rank's index among the ``dp_size`` replicas."""

    @property
    @abc.abstractmethod
    def dp_groups(self) -> list[dist.ProcessGroup]:
        """Groups whose all-reduces, one after the other, sum over the data-parallel ranks (HSDP: two)."""

    @property
    @abc.abstractmethod
    def _replica_group(self) -> Optional[dist.ProcessGroup]:
        """The ranks of one model replica (TP, or TP x PP), which gather their rows and run the same
        forward; None when a rank holds a whole replica."""

    # ------------------------------------------------------------------ forward, train, weights

    @abc.abstractmethod
    def forward_no_grad(self, batch: Batch, micro_batch_size: int, with_entropy: bool = False,
                        max_token_len: Optional[int] = None) -> dict[str, torch.Tensor]:
        """Per-token outputs for every row of this rank, micro-batched (by rows, or by valid tokens with
        ``max_token_len``: ``_micro_batches``), without gradients."""

    def train_step(
        self,
        batch: Batch,
        loss_fn: LossFn,
        mini_batch_size: int,
        micro_batch_size: int,
        epochs: int = 1,
        *,
        with_entropy: bool = True,
        entropy_grad: bool = True,
        max_token_len: Optional[int] = None,
    ) -> dict[str, float]:
        """``epochs`` passes over ``batch``, one optimizer step per mini-batch of ``mini_batch_size`` rows,
        all at the learning rate of this training step: the schedule advances once per call, as verl's
        does, so ``lr_warmup_steps`` and the cosine's length count training steps whatever the mini-batches.

        Sizes are per rank. With a model replica of k ranks (TP, or TP x PP), a mini-batch is the
        replica's union (``mini_batch_size * k`` rows) cut into micro-batches of ``micro_batch_size``,
        or, with ``max_token_len``, of at most that many valid tokens (``micro_batches``).
        ``with_entropy=False`` skips the entropy; ``entropy_grad=False`` computes it as a metric
        without a gradient (in the log-prob pass, far cheaper) when the loss has no entropy bonus.
        Returns the loss metrics, plus ``{role}/lr`` (of the last step) and ``{role}/grad_norm`` (mean over
        steps, before clipping): a share (``algos.utils.Share``: the loss and what it aggregates) summed
        over micro-batches and DP ranks, which is its mini-batch's value, then averaged over mini-batches;
        any other metric averaged over micro-batches and DP ranks. ``loss_fn`` must return the same metric
        keys on every rank.
        """
        optimizer, scheduler = self.optimizer, self.scheduler
        if optimizer is None or scheduler is None:
            raise ValueError(f"the {self.role} engine is frozen and has no optimizer; train_step needs actor "
                             f"or critic")
        self._check_rows(len(batch))
        self.model.train()
        sums: dict[str, float] = {}
        shares: set[str] = set()  # keys whose values are shares of a mini-batch's total (algos.utils.Share)
        n_micro = n_mini = 0
        norms: list[float] = []
        lr = optimizer.param_groups[0]["lr"]
        for _ in range(epochs):
            for mini in batch.split(mini_batch_size):
                mini = self._gather(mini)
                scale = self._loss_scale(mini)
                micros, n_pad = self._micro_batches(mini, micro_batch_size, max_token_len)
                micros = [m.to(self.device) for m in micros]
                for metrics in self._forward_backward(micros, loss_fn, scale, with_entropy, entropy_grad):
                    for k, v in metrics.items():
                        sums[k] = sums.get(k, 0.0) + float(v)
                        if isinstance(v, Share):
                            shares.add(k)
                    n_micro += 1
                n_mini += 1
                if n_pad:
                    pad = [micros[0].select(slice(0, 1))] * n_pad
                    self._forward_backward(pad, zero_loss, scale, with_entropy, entropy_grad)
                self._finish_grads()
                norms.append(self._clip_grads())
                # A non-finite norm would poison the weights and Adam's moments: skip this update.
                if math.isfinite(norms[-1]):
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                self.global_step += 1
        scheduler.step()
        out = self._reduce_loss_metrics(sums, n_micro, shares, n_mini)
        prefix = "critic" if self.role == "critic" else "actor"
        out[f"{prefix}/lr"] = float(lr)
        out[f"{prefix}/grad_norm"] = sum(norms) / max(1, len(norms))
        out.update(self._step_metrics(prefix))
        return out

    def _step_metrics(self, prefix: str) -> dict[str, float]:
        """What a backend measured in this step's forwards besides the loss (an MoE model's routing), the
        same on every rank."""
        return {}

    def base_reference(self) -> Optional[LogProbSource]:
        """The reference policy this engine can serve itself (a LoRA model with its adapters off), or None
        when the reference needs an engine of its own."""
        return None

    @abc.abstractmethod
    def export_weights(self, dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) tensors under Hugging Face names, optionally cast to ``dtype``, never the
        whole model gathered at once."""

    def offload(self) -> None:
        """Optimizer moments to the CPU and gradients dropped while the rollout engine has the device
        (a frozen engine has no optimizer: nothing to do)."""
        if self.optimizer is None:
            return
        self.optimizer.zero_grad(set_to_none=True)
        move_optimizer_state(self.optimizer, lambda p: torch.device("cpu"))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def onload(self) -> None:
        """Optimizer moments back next to their parameters (on the device, or the CPU under CPU offload)."""
        if self.optimizer is not None:
            move_optimizer_state(self.optimizer, lambda p: p.device)

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """Sharded model + optimizer + scheduler state for torch.distributed.checkpoint."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """Inverse of ``state_dict``, except that the optimizer's hyperparameters and LR schedule stay the
        configured ones (``_keep_configured``): a resume with a changed lr, betas or schedule applies them."""

    def _keep_configured(self, configured: dict) -> None:
        """After the checkpoint's optimizer and scheduler state were loaded: the ``configured`` settings
        (``optim.optimizer_settings`` before the load) win; rank 0 prints one line per changed value, and a
        change that cannot be applied is a ConfigError on every rank."""
        try:
            lines = restore_settings(self.optimizer, self.scheduler, configured, self.role)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if not dist.is_initialized() or dist.get_rank() == 0:
            for line in lines:
                print(f"[checkpoint] {line}", flush=True)

    # ------------------------------------------------------------------ hooks of train_step

    @abc.abstractmethod
    def _forward_backward(self, micros: list[Batch], loss_fn: LossFn, scale: LossScale, with_entropy: bool,
                          entropy_grad: bool) -> list[dict[str, float]]:
        """Forward and backward of every micro-batch (on ``device``), accumulating gradients; returns
        the metrics of each micro-batch whose loss this rank computed (under PP: the last stage's)."""

    def _finish_grads(self) -> None:
        """Gradient sums over ranks that the backward did not do itself (FSDP's reduce-scatter does)."""

    @abc.abstractmethod
    def _clip_grads(self) -> float:
        """The global gradient norm before clipping, each parameter counted once; clips the gradients
        to ``max_grad_norm`` when that is > 0 and the norm is finite and above it."""

    def _reduce_loss_metrics(self, sums: dict[str, float], n_micro: int, shares: set[str], n_mini: int
                             ) -> dict[str, float]:
        """Loss metrics summed over this rank's micro-batches, over DP ranks: shares per mini-batch, the
        rest per micro-batch (``train_step``)."""
        keys = sorted(sums)
        t = torch.tensor(
            [sums[k] for k in keys] + [float(n_micro)], dtype=torch.float64, device=self._comm_device()
        )
        self._dp_all_reduce(t)
        return loss_metric_means(keys, t, shares, n_mini)

    # ------------------------------------------------------------------ collectives, rows

    def _comm_device(self) -> torch.device:
        """Where count and metric tensors go for a collective: the CPU for gloo, else the device."""
        return torch.device("cpu") if self.device.type == "cpu" else self.device

    def _dp_all_reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
                       ) -> torch.Tensor:
        """All-reduce over the whole data-parallel group (every group of ``dp_groups``), in place."""
        if self.dp_size > 1:
            for group in self.dp_groups:
                dist.all_reduce(t, op=op, group=group)
        return t

    def _check_rows(self, n: int) -> None:
        """Every rank must run the same number of micro-batches, or the collectives hang: fail loudly."""
        t = torch.tensor([n, -n], dtype=torch.int64, device=self._comm_device())
        self._dp_all_reduce(t, op=dist.ReduceOp.MAX)
        if self._replica_group is not None:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._replica_group)
        if int(t[0]) != -int(t[1]):
            raise ValueError(
                f"{self.role} engine: ranks hold different numbers of rows (this rank {n}, "
                f"min {-int(t[1])}, max {int(t[0])}); shard the batch evenly over the world"
            )

    def _gather(self, batch: Batch) -> Batch:
        """The rows of this model replica, in replica-rank order, the same on each of its ranks."""
        if self._replica_group is None:
            return batch
        return gather_rows(batch, self._replica_group, self._comm_device())

    def _own_rows(self, out: dict[str, torch.Tensor], batch: Batch) -> dict[str, torch.Tensor]:
        """This rank's rows of outputs computed on ``_gather(batch)``, on the batch's device; gathered rows
        are padded to the replica's longest response, so they are cut back to this rank's width."""
        if self._replica_group is not None:
            start = dist.get_rank(self._replica_group) * len(batch)
            resp = batch["response_mask"].shape[1]
            # [N, R] per-token outputs, or [N] (a reward model's scores)
            out = {k: v[start : start + len(batch), :resp] if v.ndim == 2 else v[start : start + len(batch)]
                   for k, v in out.items()}
        return {k: v.to(batch["input_ids"].device) for k, v in out.items()}

    def _micro_batches(self, batch: Batch, micro_batch_size: int, max_token_len: Optional[int]
                       ) -> tuple[list[Batch], int]:
        """(micro-batches of ``batch``, how many empty ones this rank must add). Every rank must run as many
        forwards and backwards as the others: FSDP all-gathers and reduce-scatters in each. Cut by rows
        they agree (``_check_rows``); cut by tokens (``micro_batches``) a rank with fewer runs the
        difference with a zero-weight loss."""
        if max_token_len is None:
            return list(batch.split(micro_batch_size)), 0
        micros = micro_batches(batch, max_token_len)
        t = torch.tensor([len(micros)], dtype=torch.int64, device=self._comm_device())
        self._dp_all_reduce(t, op=dist.ReduceOp.MAX)
        return micros, int(t[0]) - len(micros)

    def _loss_scale(self, mini: Batch) -> LossScale:
        """The mini-batch's ``loss_denominators`` summed over all DP ranks (a replica's ranks hold the same
        rows)."""
        counts = loss_denominators(mini["response_mask"]).to(self._comm_device())  # [2]: tokens, rows
        self._dp_all_reduce(counts)
        return LossScale(global_tokens=float(counts[0]), global_seqs=float(counts[1]))


def micro_batches(batch: Batch, max_token_len: int) -> list[Batch]:
    """Consecutive rows of ``batch`` grouped while their valid (attended) tokens stay within ``max_token_len``
    (verl's ``use_dynamic_bsz``); a row longer than that is a micro-batch of its own. Rows keep their order,
    so outputs concatenate back into the batch's."""
    lengths = batch["attention_mask"].sum(1).tolist()  # [N]
    out, start, total = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and total + n > max_token_len:
            out.append(batch.select(slice(start, i)))
            start, total = i, 0
        total += n
    out.append(batch.select(slice(start, len(lengths))))
    return out


def zero_loss(outputs: dict[str, torch.Tensor], micro: Batch, scale: LossScale
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """A padding micro-batch's loss: zero gradients, through every parameter the forward used."""
    return sum(v.sum() for v in outputs.values()) * 0.0, {}


def gather_rows(batch: Batch, group: dist.ProcessGroup, comm_device: torch.device) -> Batch:
    """Rows of every rank of ``group``, in group-rank order; prompts left-padded and responses
    right-padded to the group's longest. Non-tensor fields are dropped (losses only read tensors).

    Model-parallel ranks (TP, PP) hold different rows of the world-sharded batch but must run the
    same forward; every rank holds the same number of rows, so rank r's rows of the result are
    ``[r * len(batch), (r + 1) * len(batch))``.
    """
    size = dist.get_world_size(group)
    P, R = batch.widths
    shapes = [torch.zeros(2, dtype=torch.int64, device=comm_device) for _ in range(size)]
    dist.all_gather(shapes, torch.tensor([P, R], device=comm_device), group=group)
    batch = batch.padded(max(int(s[0]) for s in shapes), max(int(s[1]) for s in shapes))
    out = {}
    for key, v in batch.tensors.items():
        v = v.contiguous().to(comm_device)
        parts = [torch.empty_like(v) for _ in range(size)]
        dist.all_gather(parts, v, group=group)
        out[key] = torch.cat(parts).to(batch["input_ids"].device)
    return Batch(out)
