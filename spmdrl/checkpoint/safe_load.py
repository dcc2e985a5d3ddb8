"""torch.distributed.checkpoint folders that load without running pickle from the files.

DCP's ``.metadata`` goes through an unpickler that resolves only an exact list
of DCP's metadata classes (``_ALLOWED``) and may point the reader only at files
in its own folder; tensors and DCP's non-tensor items (optimizer groups, LR
schedule, step) load with ``torch.load(weights_only=True)``.

    save_state(engine.state_dict(), folder / "actor", group)    # collective
    load_state(state, folder / "actor", group)                  # collective, in place
    load_state({"model": templates}, folder / "actor")          # one plain process, no process group
"""

from __future__ import annotations

import pickle
from pathlib import Path, PosixPath
from typing import IO, Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner.load_bytes uses
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo

from spmdrl.errors import ConfigError

_MISSING = object()
METADATA = ".metadata"  # DCP's name for it


# Every global a DCP ``.metadata`` of this project's checkpoints refers to (listed with pickletools from
# checkpoints of both engines, sharded and replicated, optimizer included), as exact (module, name) pairs
# mapped to the object itself: nothing is looked up by name, so a dotted name such as
# ``torch.distributed.checkpoint.metadata`` + ``os.system`` reaches nothing.
_ALLOWED: dict[tuple[str, str], Any] = {
    **{("torch.distributed.checkpoint.metadata", cls.__name__): cls for cls in (
        _md.Metadata, _md.MetadataIndex, _md.TensorStorageMetadata, _md.BytesStorageMetadata,
        _md.ChunkStorageMetadata, _md.TensorProperties, _md.StorageMeta, _md._MEM_FORMAT_ENCODING)},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # how torch pickles a layout
    ("pathlib", "PosixPath"): PosixPath,  # StorageMeta.checkpoint_id
    # A dtype pickles as its name in ``torch`` (torch.float32 -> torch.float32); dtypes are not callable.
    **{("torch", str(dt).removeprefix("torch.")): dt for dt in vars(torch).values()
       if isinstance(dt, torch.dtype)},
}
_CLASSES = tuple(v for v in _ALLOWED.values() if isinstance(v, type))


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata and nothing else: a tampered ``.metadata`` cannot run code."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except (KeyError, TypeError):  # TypeError: a name that is not a string
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata") from None


def _unpickle(f: IO[bytes]) -> Any:
    """The pickle in ``f`` through ``_MetadataUnpickler``; any failure is an UnpicklingError.

    The allowed callables do nothing harmful whatever their arguments, but pickle's BUILD can also set
    attributes on an allowed class itself, for the whole process: such a change is undone and refused.
    """
    before = [dict(vars(cls)) for cls in _CLASSES]
    try:
        return _MetadataUnpickler(f).load()
    except pickle.UnpicklingError:
        raise
    except Exception as err:  # a truncated file, or an allowed class built from arguments it rejects
        raise pickle.UnpicklingError(f"not DCP metadata ({type(err).__name__}: {err})") from None
    finally:
        for cls, old in zip(_CLASSES, before):
            if vars(cls) != old:
                for key in set(vars(cls)) - set(old):
                    delattr(cls, key)
                for key, value in old.items():
                    if vars(cls).get(key, _MISSING) is not value:
                        setattr(cls, key, value)
                raise pickle.UnpicklingError(f"a change to the class {cls.__qualname__} is not allowed in "
                                             f"checkpoint metadata")


def _inside(folder: Path, name: Any) -> bool:
    """Whether ``folder/name`` is a file of ``folder`` itself: no absolute path, ``..``, subfolder, or
    symbolic link that leads elsewhere."""
    return (isinstance(name, str) and name == Path(name).name and name not in ("", ".", "..")
            and (folder / name).resolve().parent == folder.resolve())


def _check(metadata: Any, folder: Path) -> None:
    """Refuse what is not DCP metadata, or points DCP's reader at files outside ``folder``."""
    if not isinstance(metadata, _md.Metadata) or not isinstance(metadata.storage_data, dict):
        raise pickle.UnpicklingError(f"a {type(metadata).__name__} is not DCP metadata")
    for info in metadata.storage_data.values():
        if not isinstance(info, _StorageInfo) or not _inside(folder, info.relative_path):
            where = getattr(info, "relative_path", info)
            raise pickle.UnpicklingError(f"the data file {where!r} is not a file in its folder")
        if info.transform_descriptors:  # DCP's compression extensions: spmdrl never writes them
            raise pickle.UnpicklingError(f"the transforms {info.transform_descriptors!r} are not used by "
                                         f"spmdrl checkpoints")


def read_metadata(folder: Path) -> Any:
    """The DCP ``Metadata`` of the folder ``folder``, unpickled safely and checked; ConfigError naming the
    file when it is refused or unreadable."""
    try:
        if not _inside(folder, METADATA):
            raise pickle.UnpicklingError("a symbolic link out of its folder is not allowed")
        with open(folder / METADATA, "rb") as f:
            metadata = _unpickle(f)
        _check(metadata, folder)
    except (OSError, pickle.UnpicklingError) as err:
        why = err.strerror if isinstance(err, OSError) else str(err)
        raise ConfigError(f"checkpoint {str(folder.parent)!r} could not be loaded ({folder.name}/{METADATA}: "
                          f"{why})") from None
    return metadata


class _CheckedReader(FileSystemReader):
    """DCP's file reader, handed metadata that ``read_metadata`` already checked (tensors load
    weights-only in DCP itself). No ``rank`` argument: DCP then never falls back to per-rank metadata."""

    def __init__(self, folder: Path, metadata: Any) -> None:
        super().__init__(str(folder))
        self._metadata = metadata

    def read_metadata(self) -> Any:
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = _md.StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


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
    metadata = read_metadata(path)  # on every rank: the same file, so the same verdict everywhere
    try:
        dcp.load(state, storage_reader=_CheckedReader(path, metadata), planner=SafeLoadPlanner(),
                 process_group=process_group)
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        if isinstance(err, CheckpointException) and err.failures:
            err = next(iter(err.failures.values()))[0]  # the first failing rank's own exception
        text = " ".join(str(err).split())
        raise ConfigError(f"checkpoint {str(path.parent)!r} could not be loaded ({path.name}: "
                          f"{text[:300]})") from None


def load_model_tensors(path: Path, shapes: dict[str, list[int]],
                       dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Full tensors of the named entries of the ``model`` state saved in the DCP folder ``path``, read in
    this process without a process group, whatever world size saved them (for the engines' readers)."""
    state = {name: torch.empty(shape, dtype=dtype) for name, shape in shapes.items()}
    load_state({"model": state}, path)
    return state
