"""The log-prob path the fused kernel replaced, in plain torch: the whole [tokens x vocabulary] logits,
log_softmax, gather, entropy, and autograd for every gradient. Engine tests swap it in for the fused head
(``plain_head``) and compare what the engine computes and trains either way."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch.distributed.tensor import DTensor


def plain_token_outputs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
                        with_entropy: bool, entropy_grad: bool = False) -> dict[str, torch.Tensor]:
    """``logprobs.token_outputs`` over the whole vocabulary ``weight`` [V, H], the plain way."""
    logits = (hidden.reshape(*labels.shape, -1) @ weight.T).float() / temperature  # [..., V]
    ls = torch.log_softmax(logits, -1)
    out = {"logp": ls.gather(-1, labels[..., None])[..., 0].clone()}  # not a view: FSDP2 warns of those
    if with_entropy:
        entropy = -(ls.exp() * ls).sum(-1)
        out["entropy"] = entropy if entropy_grad else entropy.detach()
    return out


def _plain_forward(self, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
    # A TP-sharded head is gathered whole; full_tensor's backward hands each rank its rows' gradient.
    weight = self.weight.full_tensor() if isinstance(self.weight, DTensor) else self.weight
    return plain_token_outputs(hidden, weight, **self._call)


@contextmanager
def plain_head() -> Iterator[None]:
    """Every ``FusedLMHead`` computes the plain way inside the block."""
    from spmdrl.engines.fsdp2.lm_head import FusedLMHead

    fused = FusedLMHead.forward
    FusedLMHead.forward = _plain_forward
    try:
        yield
    finally:
        FusedLMHead.forward = fused
