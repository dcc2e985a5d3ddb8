"""FSDP2 gradient clipping and weight export over DTensor parameters.

Every function works on modules whose parameters are DTensors (FSDP2 shards, possibly composed
with TP shards) as well as on plain modules, so the same code serves 1 rank and k ranks. Names
are the Hugging Face state-dict names: the activation-checkpoint wrapper's prefix is dropped.
"""

from __future__ import annotations

import math
from typing import Iterable, Iterator

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from spmdrl.engines.fsdp2.parallelize import CHECKPOINT_PREFIX


def clip_grad_norm_(params: Iterable[nn.Parameter], max_norm: float) -> float:
    """Global L2 norm of all gradients (clipped to ``max_norm`` when > 0); returns the norm before clipping.

    Parameters may live on different meshes: with FSDP + TP the TP-split
    weights are 2-D (dp, tp) DTensors while norms and biases are 1-D dp
    DTensors, and DTensor ops refuse to mix meshes. So the norm is taken per
    mesh (``full_tensor`` turns each partial norm into the group's true norm,
    counting replicated shards once) and the per-mesh norms are combined here.
    """
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p.grad)
    sq = 0.0
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        sq += float(norm) ** 2
    total = math.sqrt(sq)
    if max_norm > 0 and math.isfinite(total) and total > max_norm:
        coef = max_norm / (total + 1e-6)
        for grads in groups.values():
            torch._foreach_mul_(grads, coef)
    return total


def hf_name(name: str) -> str:
    """The Hugging Face state-dict name of a (possibly checkpoint-wrapped) parameter."""
    return name.replace(CHECKPOINT_PREFIX, "")


def iter_full_state(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` for every parameter and persistent buffer, gathered one at a time.

    Tied weights appear once, under their first name (``model.embed_tokens.weight``
    for tied embeddings; ``lm_head.weight`` is not repeated), because
    ``named_parameters`` de-duplicates shared parameters. Peak extra memory is
    one full tensor (plus its cast).
    """
    for name, p in model.named_parameters():
        yield hf_name(name), _full(p, dtype)
    yield from _persistent_buffers(model, dtype)


@torch.inference_mode(False)  # as _full: the FSDP unshard must not run as an inference-mode op
@torch.no_grad()
def iter_unsharded_state(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` like ``iter_full_state``, gathered one FSDP unit at a time.

    Each unit (a decoder layer, then the root's embeddings / norm / heads) comes
    in one all-gather, in the FSDP mixed-precision ``param_dtype``, instead of one
    collective per parameter: ~6 collectives instead of ~50 for a 4-layer model,
    which is most of a 2-rank weight sync on gloo. Peak extra memory is one unit.
    Needs FSDP without TP (TP shards would still be DTensors after the unshard).
    """
    units = [(prefix, m) for prefix, m in model.named_modules() if isinstance(m, FSDPModule)]
    nested = [prefix for prefix, _ in units if prefix]
    for prefix, unit in units:
        unit.unshard()
        try:
            for name, p in unit.named_parameters(prefix=prefix):
                if prefix == "" and any(name.startswith(n + ".") for n in nested):
                    continue  # a nested unit's parameter: yielded with its own unit
                # A copy: the unit's gathered storage is freed by the reshard below.
                yield hf_name(name), p.detach().clone()
        finally:
            unit.reshard()
    yield from _persistent_buffers(model, None)


def _persistent_buffers(model: nn.Module, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    """The state-dict buffers (not the non-persistent ones, like RoPE's inv_freq), full, under HF names."""
    for mod_name, mod in model.named_modules():
        for b_name, b in mod.named_buffers(recurse=False):
            if b_name not in mod._non_persistent_buffers_set:
                yield hf_name(f"{mod_name}.{b_name}" if mod_name else b_name), _full(b, dtype)


@torch.inference_mode(False)  # a consumer may iterate inside inference mode (the rollout engine does)
@torch.no_grad()
def _full(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    t = t.detach()  # no autograd record of the gather
    full = t.full_tensor() if isinstance(t, DTensor) else t
    return full.to(dtype) if dtype is not None and full.is_floating_point() else full
