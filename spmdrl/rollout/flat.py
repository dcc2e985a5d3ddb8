"""Weights as flat byte buffers: a bucket of (name, tensor) pairs as one uint8 tensor and a list that says
where each part lies, so that a bucket crosses a process boundary in one piece (a broadcast between split
placement's roles, a message to vLLM's worker process) with nothing pickled."""

from __future__ import annotations

import math

import torch

ALIGN = 16  # bytes: every part of a bucket starts aligned for any dtype's view


def flatten(bucket: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[list]]:
    """(name, tensor) pairs as one uint8 buffer and [name, dtype, shape, byte offset] per part."""
    parts, pieces, offset = [], [], 0
    for name, t in bucket:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        pad = -raw.numel() % ALIGN
        parts.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset])
        pieces += [raw, raw.new_zeros(pad)] if pad else [raw]
        offset += raw.numel() + pad
    return torch.cat(pieces), parts


def unflatten(flat: torch.Tensor, parts: list[list]) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) views of a bucket ``flatten`` made (they keep the buffer alive)."""
    out = []
    for name, dtype, shape, offset in parts:
        dt = getattr(torch, dtype)
        nbytes = math.prod(shape) * dt.itemsize
        out.append((name, flat[offset:offset + nbytes].view(dt).view(shape)))
    return out
