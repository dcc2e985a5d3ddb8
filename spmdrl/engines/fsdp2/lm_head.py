"""The causal LM's ``lm_head`` replaced by the fused log-prob kernel, so the HF forward ends in per-token
log-probs and entropy instead of [tokens x vocabulary] logits.

    install_fused_head(model)                        # after LoRA, before TP and fully_shard
    with model.lm_head.scoring(labels, temperature, with_entropy, entropy_grad):
        out = model(**inputs, logits_to_keep=keep).logits    # {"logp", optional "entropy"}: [n, R]

The model's own forward still runs end to end, so FSDP2's hooks on the root module unshard the
embeddings, final norm and head before it and reduce-scatter their gradients after the backward, as they
did for ``nn.Linear``: ``FusedLMHead`` keeps the head's parameter object (tied or not) under its name
``lm_head.weight``, and only reads it at call time, as FSDP2 swaps the unsharded parameter in. Transformers
slices the hidden states to ``logits_to_keep`` before the head, and hands the head's output back as
``.logits``: here a dict, so code that post-processes logits would fail loudly rather than silently.

Under training TP the weight is a DTensor sharded by vocabulary rows (``parallelize.apply_tp``); the head
runs the kernel on its local rows with the TP group (vocab-parallel: all-reduces instead of gathered
logits).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from spmdrl.engines.logprobs import token_outputs
from spmdrl.errors import ConfigError


class FusedLMHead(nn.Module):
    """hidden [n, R, H] -> {"logp", optional "entropy"} [n, R] of the labels bound by ``scoring``."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight  # [V, H]: the same parameter object (a tied head stays tied)
        self._call: Optional[dict] = None

    @contextmanager
    def scoring(self, labels: torch.Tensor, temperature: float, with_entropy: bool, entropy_grad: bool
                ) -> Iterator[None]:
        """Bind what the model's next forward scores: ``labels`` [n, R] (one per kept position)."""
        self._call = dict(labels=labels, temperature=temperature, with_entropy=with_entropy,
                          entropy_grad=entropy_grad)
        try:
            yield
        finally:
            self._call = None

    def forward(self, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        if self._call is None:
            raise RuntimeError("FusedLMHead makes log-probs, not logits: call the model inside "
                               "lm_head.scoring(labels, ...)")
        weight, group = self.weight, None
        if isinstance(weight, DTensor):  # vocab-parallel: this rank's rows, sums over the TP group
            group = weight.device_mesh.get_group()
            weight = weight.to_local()
        return token_outputs(hidden, weight, tp_group=group, **self._call)


def install_fused_head(model: nn.Module) -> None:
    """Replace ``model.lm_head`` (a bias-free ``nn.Linear``) by a ``FusedLMHead`` on the same weight."""
    head = model.lm_head
    if type(head) is not nn.Linear:  # peft's lora.Linear, when target_modules names lm_head
        raise ConfigError(f"lm_head is a {type(head).__name__}, but the fused log-prob kernel reads the LM "
                          f"head as one plain weight; leave lm_head out of model.target_modules")
    if head.bias is not None:
        raise ConfigError("the model's lm_head has a bias, which the fused log-prob kernel does not add; "
                          "use a model with a bias-free LM head (Llama, Qwen2, Qwen3)")
    model.lm_head = FusedLMHead(head.weight)
