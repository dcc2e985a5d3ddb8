"""Split placement's batch in flight, as a checkpoint part: the batch the rollout ranks generated for the step
after the checkpoint, with its info (step, weights version, last, the rollout's metrics).

Under ``rollout.max_staleness`` 1 that batch was generated with weights the checkpoint no longer holds (one
update older), so it cannot be regenerated from the checkpoint: it is saved with it, and the resumed run
trains on it first, as the uninterrupted run did (spmdrl/split.py).

    in_flight/batch.safetensors   the batch's tensors (every training rank's rows, in rollout order)
    in_flight/batch.json          its lists (prompts' extra info, ...) and the info; {"batch": null} if none

Layout "files" (spmdrl/checkpoint/manager.py): rank 0 writes, every rank reads. Safetensors and JSON only:
nothing a file holds is unpickled.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from safetensors.torch import load_file, save_file

from spmdrl.batch import Batch


class InFlight:
    """The next step's batch, kept from the exchange until the checkpoint is written (or None)."""

    checkpoint_layout = "files"

    def __init__(self) -> None:
        self.batch: Optional[Batch] = None
        self.info: Optional[dict[str, Any]] = None

    def hold(self, batch: Batch, info: dict[str, Any]) -> None:
        self.batch, self.info = batch, info

    def take(self) -> Optional[tuple[Batch, dict[str, Any]]]:
        """The held batch and its info, once (None when nothing is held)."""
        if self.batch is None:
            return None
        held, self.batch, self.info = (self.batch, self.info), None, None
        return held

    def save_files(self, folder: Path) -> None:
        if self.batch is None:
            (folder / "batch.json").write_text(json.dumps({"batch": None}))
            return
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.batch.tensors.items()}
        save_file(tensors, str(folder / "batch.safetensors"))
        # default=str: a list item JSON lacks (a numpy scalar in extra_info) keeps its text, as in the
        # exchange.
        (folder / "batch.json").write_text(json.dumps(
            {"batch": {"non_tensor": self.batch.non_tensor}, "info": self.info}, default=str))

    def load_files(self, folder: Path) -> None:
        saved = json.loads((folder / "batch.json").read_text())
        if saved["batch"] is None:
            self.batch, self.info = None, None
            return
        tensors = load_file(str(folder / "batch.safetensors"))
        self.batch, self.info = Batch(tensors, saved["batch"]["non_tensor"]), saved["info"]
