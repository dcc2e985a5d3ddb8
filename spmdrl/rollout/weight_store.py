"""Named views into a few base tensors: in-place weight loading and storage-level sleep/wake.

Used by the native and hf rollout engines. Freeing a weight resizes its storage
to 0 bytes instead of dropping the tensor, so every view (a fused matrix's row
slice, a tied alias) survives a sleep/wake cycle and ``update_weights`` never
reallocates.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

# Checkpoint entries that are derived buffers, not weights (old Llama checkpoints ship them).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightStore:
    """Named views into a few base tensors: in-place loading and storage-level sleep/wake.

    ``slots`` maps each HF parameter name to the view it is copied into.
    Freeing resizes the base storages to 0 bytes; every view keeps pointing at the
    same storage, so re-materialising (resize back) and copying in new values makes
    them valid again without rebuilding anything.
    """

    def __init__(self, bases: list[torch.Tensor], slots: dict[str, torch.Tensor],
                 optional: Iterable[str] = ()):
        self.bases = bases
        self.slots = slots
        self.optional = set(optional)  # names a stream may omit (a tied lm_head)
        self._nbytes = [b.untyped_storage().nbytes() for b in bases]
        # Host copies of the bases while offloaded. On CUDA they are pinned buffers kept from the first
        # offload on: allocating ~1 GB of pinned memory at every sleep took ~1 s of an H100 step
        # (bench/gpu/results/2026-11-27), the copies themselves ~0.05 s.
        self._host: Optional[list[torch.Tensor]] = None
        self._offloaded = False

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]], source: str = "update_weights") -> int:
        """Copy each (hf_name, tensor) into its slot; raise on unknown, mis-shaped or missing names."""
        if not self.materialized:
            raise RuntimeError(f"{source}: weights are freed (sleep level 2); "
                               "call wake_up(('weights',)) first")
        seen: set[str] = set()
        for name, t in named_tensors:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            dst = self.slots.get(name)
            if dst is None:
                raise KeyError(f"{source}: unknown weight {name!r} for this model "
                               f"(expected HF names such as {next(iter(self.slots))!r})")
            if tuple(t.shape) != tuple(dst.shape):
                raise ValueError(f"{source}: weight {name!r} has shape {tuple(t.shape)}, "
                                 f"the model expects {tuple(dst.shape)}")
            dst.copy_(t.detach())
            seen.add(name)
        missing = sorted(set(self.slots) - seen - self.optional)
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ValueError(f"{source}: the stream did not contain {', '.join(missing[:5])}{more}")
        return len(seen)

    @property
    def materialized(self) -> bool:
        return all(b.untyped_storage().nbytes() == n for b, n in zip(self.bases, self._nbytes))

    def nbytes(self) -> int:
        """Bytes of storage these weights hold right now (on any device, the host copies included: kept once
        made)."""
        host = sum(t.untyped_storage().nbytes() for t in self._host or [])
        return sum(b.untyped_storage().nbytes() for b in self.bases) + host

    def free(self) -> None:
        self._offloaded, self._host = False, None
        for b in self.bases:
            b.untyped_storage().resize_(0)

    def materialize(self) -> None:
        """Give the bases their storage back; contents are undefined until loaded or onloaded."""
        for b, n in zip(self.bases, self._nbytes):
            if b.untyped_storage().nbytes() != n:
                b.untyped_storage().resize_(n)

    def offload(self) -> None:
        """Copy to the host and free the device storage (only meaningful off-CPU)."""
        if self.bases[0].device.type == "cpu" or not self.materialized:
            return
        if self._host is None:
            pin = self.bases[0].device.type == "cuda"
            self._host = [torch.empty(b.shape, dtype=b.dtype, pin_memory=pin) for b in self.bases]
        for b, h in zip(self.bases, self._host):
            h.copy_(b.detach(), non_blocking=True)  # into pinned memory the copies queue on the stream
        if self.bases[0].device.type == "cuda":  # the copies must finish before the storage goes
            torch.cuda.synchronize(self.bases[0].device)
        for b in self.bases:
            b.untyped_storage().resize_(0)
        self._offloaded = True

    def onload(self) -> None:
        if not self._offloaded or self._host is None:
            return
        self.materialize()
        for b, h in zip(self.bases, self._host):
            # The stream orders the copies before any use of the weights; the host buffers are written again
            # only at the next offload, after the device has long finished reading them.
            b.copy_(h, non_blocking=True)
        self._offloaded = False
