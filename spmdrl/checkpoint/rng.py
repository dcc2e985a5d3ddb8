"""Every RNG stream a rank draws from, as checkpointable state: torch (CPU, CUDA), python, numpy and the
rollout engine's sampling generator.

``RNGState`` is the checkpoint part (``per_rank``: one ``rng_rank{r}.pt`` per rank, loaded weights-only);
on another world size its streams are reseeded instead of loaded.
"""

from __future__ import annotations

import random
from typing import Any, Optional

import numpy as np
import torch


def _rollout_generator(rollout: Any) -> Optional[torch.Generator]:
    """The sampling generator of an engine that exposes one as ``generator`` (native and hf do)."""
    gen = getattr(rollout, "generator", None)
    return gen if isinstance(gen, torch.Generator) else None


def rng_state(rollout: Any, device: torch.device) -> dict:
    """Every RNG stream this rank draws from, as tensors and plain values (loadable weights-only)."""
    version, mt, gauss = random.getstate()
    name, key, pos, has_gauss, cached = np.random.get_state()
    gen = _rollout_generator(rollout)
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "python": [version, list(mt), gauss],
        "numpy": [name, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "rollout": gen.get_state() if gen is not None else None,
    }


def set_rng_state(state: dict, rollout: Any, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    name, key, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, key.numpy().astype(np.uint32), pos, has_gauss, cached))
    gen = _rollout_generator(rollout)
    if gen is not None and state["rollout"] is not None:
        gen.set_state(state["rollout"])


def reseed_rng(seed: int, step: int, rank: int, rollout: Any) -> None:
    """Streams for a resume on another world size: distinct per (seed, step, rank), not the step-0 ones."""
    s = (seed * 1_000_003 + step) * 1_009 + rank
    torch.manual_seed(s)
    random.seed(s)
    np.random.seed(s % 2**32)
    gen = _rollout_generator(rollout)
    if gen is not None:
        gen.manual_seed(s)


class RNGState:
    """This rank's RNG streams as a checkpoint part: per rank, since each rank draws its own samples."""

    checkpoint_layout = "per_rank"

    def __init__(self, rollout: Any, device: torch.device, seed: int) -> None:
        self.rollout = rollout  # its sampling generator is one of the streams
        self.device = device
        self.seed = seed

    def state_dict(self) -> dict:
        return rng_state(self.rollout, self.device)

    def load_state_dict(self, state: dict) -> None:
        set_rng_state(state, self.rollout, self.device)

    def reseed(self, step: int, rank: int) -> None:
        """Resumed on another world size: the saved per-rank streams do not map onto the new ranks."""
        reseed_rng(self.seed, step, rank, self.rollout)
