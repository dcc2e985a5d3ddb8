"""Eager attention that keeps one copy of its scores for the backward, registered with transformers.

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=lean_eager())

transformers' eager attention takes the softmax in float32 and casts it to the compute dtype, and autograd
saves both: the float32 probabilities for the softmax's backward and the cast copy for the value matmul's,
6 bytes a score in bf16. ``_Softmax`` returns the probabilities in the compute dtype and saves only those,
recomputing the float32 product in its backward (2 bytes a score in bf16; float32 runs are unchanged). On
the 0.5B shape's CPU update (16 rows of ~290 tokens, 14 heads, 24 layers) that is about 1.7 GB of the
2.6 GB the scores held. CPU trains on eager for short sequences (``resolve_attn_implementation``), where it
is several times faster than sdpa's flash kernel.
"""

from __future__ import annotations

from typing import Optional

import torch

NAME = "spmdrl_eager"


class _Softmax(torch.autograd.Function):
    """softmax(x) over the last dim in float32, returned and saved in ``dtype``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        p = torch.softmax(x, -1, dtype=torch.float32).to(dtype)
        ctx.save_for_backward(p)
        ctx.x_dtype = x.dtype
        return p

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (p,) = ctx.saved_tensors
        pf, gf = p.float(), grad.float()
        return (pf * (gf - (gf * pf).sum(-1, keepdim=True))).to(ctx.x_dtype), None


def eager(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          attention_mask: Optional[torch.Tensor], scaling: float, dropout: float = 0.0, **kwargs):
    """transformers' eager attention with ``_Softmax``: query [b, H, S, D], key / value [b, Hkv, S, D],
    an additive mask -> ([b, S, H, D], None)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = _Softmax.apply(weights, query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), None


def lean_eager() -> str:
    """Register ``eager`` (and transformers' eager mask for it) under ``NAME``; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(NAME, eager)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, eager_mask)
    return NAME
