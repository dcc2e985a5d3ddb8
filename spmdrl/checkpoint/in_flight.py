"""Split placement's batches in flight, as a checkpoint part: the batches the rollout ranks generated for the
steps after the checkpoint (``rollout.max_staleness`` of them at most), each with its info (step, weights
version, last, the rollout's metrics).

Under staleness s >= 1 the batches of steps k+1 .. k+s after a checkpoint at step k were generated with
weights the checkpoint no longer holds (updates k-s .. k-1), so they cannot be regenerated from it: they are
saved with it, and the resumed run trains on them first, as the uninterrupted run did (spmdrl/split/).

    in_flight/batch.json          {"batches": [{"non_tensor": its lists, "info": its info}, ...]}
    in_flight/batch{i}.safetensors  batch i's tensors (every training rank's rows, in rollout order)

A checkpoint written before batches were queued (one batch: ``batch.safetensors`` and ``{"batch": ...,
"info": ...}``) loads as a queue of one. Layout "files" (spmdrl/checkpoint/manager.py): rank 0 writes, every
rank reads. Safetensors and JSON only: nothing a file holds is unpickled.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from safetensors.torch import load_file, save_file

from spmdrl.batch import Batch
from spmdrl.errors import ConfigError


class InFlight:
    """The next steps' batches in order, kept from the exchange until trained on (and checkpointed)."""

    checkpoint_layout = "files"

    def __init__(self, max_staleness: int) -> None:
        self.queue: list[tuple[Batch, dict[str, Any]]] = []
        self.max_staleness = max_staleness  # this run's, saved with the batches
        self.saved_max_staleness: Optional[int] = None  # the checkpointed run's (None: not recorded)

    def __len__(self) -> int:
        return len(self.queue)

    def hold(self, batch: Batch, info: dict[str, Any]) -> None:
        self.queue.append((batch, info))

    def take(self) -> Optional[tuple[Batch, dict[str, Any]]]:
        """The first held batch and its info, once (None when nothing is held)."""
        return self.queue.pop(0) if self.queue else None

    def check_staleness(self, where: Path) -> None:
        """Batches in flight were generated for the checkpointed run's ``rollout.max_staleness``; under
        another, the two roles would disagree on which weights the next batches take: refused."""
        if self.queue and self.saved_max_staleness not in (None, self.max_staleness):
            steps = ", ".join(str(info["step"]) for _, info in self.queue)
            raise ConfigError(f"checkpoint {str(where)!r} holds the batches of steps {steps} in flight, "
                              f"generated under rollout.max_staleness {self.saved_max_staleness}, but this "
                              f"run's is {self.max_staleness}; resume with rollout.max_staleness "
                              f"{self.saved_max_staleness}, or from a checkpoint that holds none")

    def retarget(self, total_steps: int) -> None:
        """The resumed run's ``trainer.total_steps`` in place of the checkpointed run's: a held batch past it
        is never trained, the one at it is the last, and one after which the data ran out stays the last.
        (A checkpoint written before batches said so counts none as the end of the data.)"""
        self.queue = [(batch, {**info, "last": info["step"] >= total_steps or info.get("exhausted", False)})
                      for batch, info in self.queue if info["step"] <= total_steps]

    @property
    def ends(self) -> bool:
        """Whether the run's last batch is held."""
        return any(info["last"] for _, info in self.queue)

    def save_files(self, folder: Path) -> None:
        saved = []
        for i, (batch, info) in enumerate(self.queue):
            tensors = {k: v.detach().cpu().contiguous() for k, v in batch.tensors.items()}
            save_file(tensors, str(folder / f"batch{i}.safetensors"))
            saved.append({"non_tensor": batch.non_tensor, "info": info})
        # default=str: a list item JSON lacks (a numpy scalar in extra_info) keeps its text, as in the
        # exchange.
        (folder / "batch.json").write_text(json.dumps({"batches": saved, "max_staleness": self.max_staleness},
                                                      default=str))

    def load_files(self, folder: Path) -> None:
        saved = _read(folder)
        self.saved_max_staleness = saved.get("max_staleness")
        self.queue = [(Batch(load_file(str(folder / name)), part["non_tensor"]), part["info"])
                      for name, part in _parts(saved)]

    @staticmethod
    def saved_steps(folder: Path) -> list[int]:
        """The steps of the batches a checkpoint's ``folder`` holds in flight (none for a colocated run's,
        which has no such folder), without loading them."""
        return [int(part["info"]["step"]) for _, part in _parts(_read(folder))]


def _read(folder: Path) -> dict[str, Any]:
    """batch.json, or nothing held when the checkpoint has none (a colocated run's)."""
    f = folder / "batch.json"
    return json.loads(f.read_text()) if f.is_file() else {"batches": []}


def _parts(saved: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(tensor file, {non_tensor, info}) of each batch held, in order. Checkpoints written before the queue
    hold one batch or none: ``batch.safetensors`` and ``{"batch": ..., "info": ...}``."""
    if "batches" not in saved:
        one = saved["batch"]
        return [] if one is None else [("batch.safetensors", {"non_tensor": one["non_tensor"],
                                                              "info": saved["info"]})]
    return [(f"batch{i}.safetensors", part) for i, part in enumerate(saved["batches"])]
