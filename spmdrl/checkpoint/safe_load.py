"""torch.distributed.checkpoint folders that load without running pickle from the files.

DCP's ``.metadata`` goes through an unpickler that only builds DCP's metadata
classes; tensors and DCP's non-tensor items (optimizer groups, LR schedule,
step) load with ``torch.load(weights_only=True)``.

    save_state(engine.state_dict(), folder / "actor", group)    # collective
    load_state(state, folder / "actor", group)                  # collective, in place
    load_state({"model": templates}, folder / "actor")          # one plain process, no process group
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner.load_bytes uses
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from spmdrl.errors import ConfigError


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata and nothing else: a tampered ``.metadata`` cannot run code."""

    _MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")

    def find_class(self, module: str, name: str) -> Any:
        if module in self._MODULES and not name.startswith("__"):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if (module, name) in {("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                              ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "Path")}:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with a restricted unpickler for ``.metadata`` (tensors already load weights-only)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, but non-tensor items (optimizer groups, LR schedule, step) load weights-only."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def save_state(state: dict, path: Path, process_group: Optional[dist.ProcessGroup] = None) -> None:
    """Collective DCP save of a (sharded) state dict into the folder ``path``."""
    dcp.save(state, storage_writer=FileSystemWriter(str(path)), process_group=process_group)


def load_state(state: dict, path: Path, process_group: Optional[dist.ProcessGroup] = None) -> None:
    """Collective (or single-process, without a process group) DCP load into ``state``, in place.

    Any failure (DCP raises the same exception on every rank) becomes one ConfigError sentence.
    """
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner(),
                 process_group=process_group)
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        if isinstance(err, CheckpointException) and err.failures:
            err = next(iter(err.failures.values()))[0]  # the first failing rank's own exception
        text = " ".join(str(err).split())
        # DCP's "metadata is None; global metadata read failed: X; rank local ..." -> X
        text = text.split("global metadata read failed: ")[-1].split("; rank local metadata")[0]
        where = f"checkpoint {str(path.parent)!r}"
        raise ConfigError(f"{where} could not be loaded ({path.name}: {text[:300]})") from None


def load_model_tensors(path: Path, shapes: dict[str, list[int]],
                       dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Full tensors of the named entries of the ``model`` state saved in the DCP folder ``path``, read in
    this process without a process group, whatever world size saved them (for the engines' readers)."""
    state = {name: torch.empty(shape, dtype=dtype) for name, shape in shapes.items()}
    load_state({"model": state}, path)
    return state
