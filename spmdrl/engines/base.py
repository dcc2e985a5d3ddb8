"""The training-engine interface the loop talks to.

An engine owns one sharded model (actor, reference or critic) and its
optimizer. The loop never sees FSDP2 vs Megatron: it calls

    out = engine.forward_no_grad(batch, micro_batch_size)      # {"logp": [N,R], ...}
    metrics = engine.train_step(batch, loss_fn, mini_batch_size, micro_batch_size, epochs)
    for name, full_tensor in engine.export_weights(): ...    # HF names, one tensor at a time
    engine.offload(); engine.onload()                         # around rollout
    engine.state_dict(); engine.load_state_dict(sd)           # checkpoints (DCP)

Each engine class is built by ``from_config(cfg, role, model_path=..., dims=..., device=...,
total_steps=...)`` with the run's ``ParallelDims``: an engine takes the meshes it needs from it
(FSDP2: the FSDP and TP meshes; Megatron: TP, PP and DP), so adding a parallel axis does not
change the factory. ``check_config(cfg)`` refuses what the engine cannot do before any work.

``loss_fn(outputs, micro_batch, scale) -> (loss, metrics)`` receives the
forward outputs of one micro-batch and a ``LossScale`` with the mini-batch's
global counts, so token-mean losses divide by the global number of valid
tokens and gradient accumulation and DP do not change the update.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Literal, Optional

import torch
import torch.distributed as dist

from spmdrl.batch import Batch
from spmdrl.engines.optim import move_optimizer_state

if TYPE_CHECKING:
    from spmdrl.config import Config
    from spmdrl.parallel import ParallelDims


@dataclass
class LossScale:
    """Global denominators of one mini-batch, all-reduced over the data-parallel group."""

    global_tokens: float  # valid response tokens in the mini-batch over all DP ranks
    global_seqs: float  # responses in the mini-batch over all DP ranks
    # No DP correction here: an engine whose gradient reduction averages (FSDP2) scales its own backward.


LossFn = Callable[[dict[str, torch.Tensor], Batch, LossScale], tuple[torch.Tensor, dict[str, float]]]


class TrainEngine(abc.ABC):
    optimizer: Optional[torch.optim.Optimizer]  # None for a frozen engine (reference, reward model)
    device: torch.device

    @classmethod
    def check_config(cls, cfg: "Config") -> None:
        """Raise ValueError (one sentence) when ``cfg`` asks this engine for something it cannot do;
        runs before any process group or model exists. The default accepts everything."""

    @classmethod
    @abc.abstractmethod
    def from_config(
        cls,
        cfg: "Config",
        role: Literal["actor", "ref", "critic"],
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

    @abc.abstractmethod
    def forward_no_grad(self, batch: Batch, micro_batch_size: int, with_entropy: bool = False) -> dict[str, torch.Tensor]:
        """Per-token outputs for every row, micro-batched, without gradients."""

    @abc.abstractmethod
    def train_step(
        self, batch: Batch, loss_fn: LossFn, mini_batch_size: int, micro_batch_size: int, epochs: int = 1
    ) -> dict[str, float]:
        """``epochs`` passes of optimizer steps over mini-batches; returns averaged metrics."""

    @abc.abstractmethod
    def export_weights(self, dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) tensors under Hugging Face names, optionally cast to ``dtype``, never the
        whole model gathered at once."""

    def offload(self) -> None:
        """Optimizer moments to the CPU and gradients dropped while the rollout engine has the device (a frozen
        engine has no optimizer: nothing to do). Engines set ``optimizer`` and ``device``."""
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
        """Inverse of ``state_dict``."""


def gather_rows(batch: Batch, group: dist.ProcessGroup, comm_device: torch.device) -> Batch:
    """Rows of every rank of ``group``, in group-rank order; prompts left-padded and responses
    right-padded to the group's longest. Non-tensor fields are dropped (losses only read tensors).

    Model-parallel ranks (TP, PP) hold different rows of the world-sharded batch but must run the
    same forward; every rank holds the same number of rows, so rank r's rows of the result are
    ``[r * len(batch), (r + 1) * len(batch))``.
    """
    size = dist.get_world_size(group)
    total, resp = batch["input_ids"].shape[1], batch["response_mask"].shape[1]
    shapes = [torch.zeros(2, dtype=torch.int64, device=comm_device) for _ in range(size)]
    dist.all_gather(shapes, torch.tensor([total - resp, resp], device=comm_device), group=group)
    p_max = max(int(s[0]) for s in shapes)
    r_max = max(int(s[1]) for s in shapes)
    out = {}
    for key, v in batch.tensors.items():
        if v.dim() >= 2 and v.shape[1] == total:
            pad_p, pad_r = p_max - (total - resp), r_max - resp
            v = torch.cat(
                [
                    v.new_zeros(v.shape[0], pad_p, *v.shape[2:]),
                    v[:, : total - resp],
                    v[:, total - resp :],
                    v.new_zeros(v.shape[0], pad_r, *v.shape[2:]),
                ],
                dim=1,
            )
        elif v.dim() >= 2 and v.shape[1] == resp:
            v = torch.cat([v, v.new_zeros(v.shape[0], r_max - resp, *v.shape[2:])], dim=1)
        v = v.contiguous().to(comm_device)
        parts = [torch.empty_like(v) for _ in range(size)]
        dist.all_gather(parts, v, group=group)
        out[key] = torch.cat(parts).to(batch["input_ids"].device)
    return Batch(out)
