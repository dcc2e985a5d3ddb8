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


def cuda_handle(flat: torch.Tensor) -> list:
    """A CUDA IPC handle of the uint8 buffer ``flat`` as plain values (ints, bytes, a bool), for another
    process that sees this GPU to map (``from_cuda_handle``) without a copy through the host. torch's own
    sharing (``torch.multiprocessing``) keeps the memory alive until the other process lets go of it; only
    the values travel, never a pickled object."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(flat)
    # (tensor class, size, stride, offset, storage class, dtype, device, handle, storage bytes, storage
    # offset bytes, requires_grad, ref counter handle, ref counter offset, event handle, event sync)
    return [flat.numel(), args[3], *args[7:10], *args[11:15]]


def from_cuda_handle(handle: list, device: int) -> torch.Tensor:
    """The uint8 buffer ``cuda_handle`` shared, mapped on the GPU where the sender holds it: ``device``, its
    index among this process's visible devices (the sender's process may number it otherwise)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    numel, offset, ipc, size, storage_offset, counter, counter_offset, event, sync = handle
    return rebuild_cuda_tensor(torch.Tensor, torch.Size([numel]), (1,), offset, torch.UntypedStorage,
                               torch.uint8, device, ipc, size, storage_offset, False,
                               counter, counter_offset, event, sync)
