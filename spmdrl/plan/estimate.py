"""Bytes one rank holds in each phase of a step, by component, from the config alone.

    phases = estimate(cfg, world_size)    # {"rollout": {"actor weights": b, ...}, "update": {...}, ...}

What a rank holds while training (each trained model: sharded master weights, AdamW's two moments, and in
the update the sharded gradients; the frozen reference in its compute dtype), what the rollout engine
holds awake (weights, KV cache, decode temporaries) and asleep (``rollout.sleep_level``), what each
forward adds (the unsharded root and the layers FSDP gathers ahead, a micro-batch's activations: saved
for backward in the update, one layer's worth in a no-grad pass; the LM head's chunked log-prob
temporaries, never [tokens x vocab]), and the process itself (``runtime``).

Micro-batches are sized for their worst case: every row at data.max_prompt_length +
data.max_response_length, a token budget filled. The constants below were measured on CPU (AMD EPYC
Zen 4, torch 2.13, bf16 autocast of float32 masters) with ``trainer.exact_memory``; each says what it
stands for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from spmdrl.config.shape import ModelShape
from spmdrl.precision import resolve_dtype, to_dtype

if TYPE_CHECKING:
    from spmdrl.config import Config

GB = 1024**3
# Bytes saved for backward per token and decoder layer, in units of the compute dtype's size: the layer's
# input and RMSNorm outputs, q/k/v after RoPE (k, v repeated to every query head), the attention output,
# and the MLP's gate, up, SiLU and product (8 H + 4 I, fewer with the fused SwiGLU that saves gate and up).
SAVED_H, SAVED_I = 8, 4
# A no-grad forward holds one layer's temporaries at a time: the residual stream in and out, q/k/v,
# the MLP's two halves and their product.
NO_GRAD_H, NO_GRAD_I = 6, 3
# Eager attention (CPU's default up to 2048 tokens) keeps each row's [heads, S, S] scores in float32 and
# bf16 (saved for backward in training); sdpa keeps none.
EAGER_SCORE_BYTES = 6
# The backward of one decoder layer holds its gradients' temporaries on top of what was saved: the
# attention's q, k, v and output gradients, and the MLP's gate, up and product gradients (4 H + 3 I a token).
# With activation checkpointing this is the slope of the update's peak over the sequence length.
BACKWARD_H, BACKWARD_I = 4, 3
# Ulysses (parallel.sp): per token of this rank and decoder layer, the all-to-all's q, k, v and attention
# output over the whole sequence with 1/sp of the heads, in the compute dtype (saved for backward; their
# gradients take the same all-to-alls back in the backward).
ULYSSES_H = 4
# The fused log-prob kernel's temporaries (spmdrl/engines/logprobs.py): blocks of at most
# ``chunk_elements(device)`` logits, two float32 buffers and one in the compute dtype, reused by every
# block; no [tokens x vocab] tensor.
LOGPROB_BLOCKS = 3
# AdamW keeps exp_avg and exp_avg_sq in the parameter's dtype; its foreach step makes one more such buffer
# for the whole group at once (the denominator sqrt(v) + eps) when the backward's memory is free again.
ADAM_STATES = 2
ADAM_STEP_BUFFERS = 1


@dataclass(frozen=True)
class Sizes:
    """The dtypes and token counts the estimate needs, resolved from the config for one device type."""

    master: int  # bytes per trained weight (model.dtype)
    compute: int  # bytes per element of a forward (actor.param_dtype)
    rollout: int  # bytes per engine weight and KV element (rollout.dtype)
    seq: int  # longest prompt + response
    response: int
    eager: bool  # eager attention (its score tensors)
    device_type: str = "cpu"  # the fused log-prob kernel's blocks are larger on a GPU

    @classmethod
    def of(cls, cfg: "Config", device_type: str) -> "Sizes":
        from spmdrl.engines.fsdp2.engine import resolve_attn_implementation

        d = cfg.data
        seq = d.max_prompt_length + d.max_response_length
        attn = resolve_attn_implementation(cfg.model.attn_implementation, device_type, seq)
        return cls(master=_bytes(cfg.model.dtype), compute=_bytes(resolve_dtype(cfg.actor.param_dtype,
                                                                                device_type)),
                   rollout=_bytes(resolve_dtype(cfg.rollout.dtype, device_type)), seq=seq,
                   response=d.max_response_length,
                   eager=attn == "eager" and not cfg.model.use_remove_padding and cfg.parallel.sp == 1,
                   device_type=device_type)


def _bytes(dtype: "str | torch.dtype") -> int:
    return torch.finfo(to_dtype(dtype)).bits // 8


def micro_tokens(rows: int, seq: int, budget: Optional[int]) -> int:
    """Tokens of the largest micro-batch: ``rows`` rows of ``seq``, or a filled token budget (a row longer
    than the budget still runs alone)."""
    return rows * seq if budget is None else max(min(budget, rows * seq), seq)


def activations(shape: ModelShape, tokens: int, rows: int, s: Sizes, *, train: bool, checkpointing: bool,
                tp: int = 1, layers: Optional[int] = None, sp: int = 1) -> float:
    """Bytes a forward of ``tokens`` tokens in ``rows`` rows holds at its peak: saved for backward in
    training (one layer's input per layer and one layer in full with activation checkpointing), one
    layer's temporaries without gradients. ``tp`` splits heads and the MLP; ``layers``: this rank's; ``sp``
    splits the tokens (each rank 1/sp of them, plus the all-to-all's buffers; packed, so no eager scores)."""
    n_layers = shape.layers if layers is None else layers
    h, mlp = shape.hidden, shape.intermediate / tp
    local = tokens / sp
    scores = EAGER_SCORE_BYTES * shape.heads / tp * (tokens / max(rows, 1)) * tokens if s.eager else 0.0
    swaps = ULYSSES_H * h * local * s.compute if sp > 1 else 0.0
    full = (SAVED_H * h + SAVED_I * mlp) * local * s.compute + scores + swaps
    if not train:
        return (NO_GRAD_H * h + NO_GRAD_I * mlp) * local * s.compute + scores + swaps
    backward = (BACKWARD_H * h + BACKWARD_I * mlp) * local * s.compute + swaps
    if checkpointing:
        return n_layers * h * local * s.compute + full + backward
    return n_layers * full + backward


def logprob_temporaries(shape: ModelShape, tokens: int, tp: int = 1, device_type: str = "cpu") -> float:
    """The LM head's fused log-prob kernel: blocks of at most ``chunk_elements(device_type)`` logits."""
    from spmdrl.engines.logprobs import chunk_elements

    vocab = shape.vocab / tp
    rows = max(1, min(tokens, chunk_elements(device_type) // max(1, int(vocab))))
    return LOGPROB_BLOCKS * rows * vocab * 4


def trained_state(params: int, trainable: int, shards: int, s: Sizes) -> dict[str, float]:
    """A trained model's sharded master weights, AdamW moments and (update only) gradients."""
    return {"weights": params * s.master / shards, "optimizer": ADAM_STATES * trainable * s.master / shards,
            "gradients": trainable * s.master / shards,
            "step": ADAM_STEP_BUFFERS * trainable * s.master / shards}


def gathered(shape: ModelShape, s: Sizes, tp: int, prefetch: int = 2) -> float:
    """What FSDP unshards during a forward in the compute dtype: the root (embeddings, final norm, LM head,
    kept until the backward) and the layers gathered ahead."""
    return (shape.root_params + prefetch * shape.layer_params) * s.compute / tp


def routing_record(shape: ModelShape, rows: int, seq: int) -> float:
    """An MoE model's routing record (batch.py's ``routed_experts``) of ``rows`` rows of ``seq`` tokens: k
    expert ids a token in each layer, one byte each below 255 experts, else four."""
    if not shape.experts:
        return 0.0
    k = shape.intermediate // shape.expert_intermediate  # a token's MLP is its k routed experts'
    return float(rows * seq * shape.layers * k * (1 if shape.experts < 255 else 4))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def gb(x: float) -> float:
    return x / GB


def fits(need: float, budget: float, margin: float) -> bool:
    return need <= budget * (1 - margin) and not math.isnan(need)
