"""The training-engine interface the loop talks to.

An engine owns one sharded model (actor, reference or critic) and its
optimizer. The loop never sees FSDP2 vs Megatron: it calls

    out = engine.forward_no_grad(batch, micro_batch_size)      # {"logp": [N,R], ...}
    metrics = engine.train_step(batch, loss_fn, mini_batch_size, micro_batch_size, epochs)
    for name, full_tensor in engine.export_weights(): ...    # HF names, one tensor at a time
    engine.offload(); engine.onload()                         # around rollout
    engine.state_dict(); engine.load_state_dict(sd)           # checkpoints (DCP)

``loss_fn(outputs, micro_batch, scale) -> (loss, metrics)`` receives the
forward outputs of one micro-batch and a ``LossScale`` with the mini-batch's
global counts, so token-mean losses divide by the global number of valid
tokens and gradient accumulation and DP do not change the update.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import torch

from spmdrl.batch import Batch

if TYPE_CHECKING:
    from spmdrl.config import Config


@dataclass
class LossScale:
    """Global denominators of one mini-batch, all-reduced over the data-parallel group."""

    global_tokens: float  # valid response tokens in the mini-batch over all DP ranks
    global_seqs: float  # responses in the mini-batch over all DP ranks
    dp_size: int  # FSDP averages gradients over DP; losses are multiplied by this to undo it


LossFn = Callable[[dict[str, torch.Tensor], Batch, LossScale], tuple[torch.Tensor, dict[str, float]]]


class TrainEngine(abc.ABC):
    @classmethod
    def check_config(cls, cfg: "Config") -> None:
        """Raise ValueError (one sentence) when ``cfg`` asks this engine for something it cannot do;
        runs before any process group or model exists. The default accepts everything."""

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

    @abc.abstractmethod
    def offload(self) -> None:
        """Move optimizer state and gradients off the device."""

    @abc.abstractmethod
    def onload(self) -> None:
        """Bring optimizer state back to the device."""

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """Sharded model + optimizer + scheduler state for torch.distributed.checkpoint."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """Inverse of ``state_dict``."""
