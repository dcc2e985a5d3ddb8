"""Where checkpoints live and whether one is complete: folder names, the manifest, resume resolution, and the
fsync / atomic-replace / rename-then-delete helpers that keep a killed save from looking finished.

    {output_dir}/checkpoints/global_step_N/manifest.json     written last (see manager.py for the folder)
    {output_dir}/checkpoints/latest                          names the newest complete one

A folder counts as a checkpoint only when its name is ``global_step_N`` and
its manifest parses; ``*.tmp`` (a save in progress or killed), ``*.deleting``
and ``*.superseded`` never do.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Optional

from spmdrl.errors import ConfigError

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT = "spmdrl-checkpoint/1"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def step_of(path: Path) -> Optional[int]:
    return int(m.group(1)) if (m := _STEP_DIR.match(path.name)) else None


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint under ``root``, oldest first.

    ``*.tmp`` (a save in progress or killed) and folders without a parsable
    manifest (a save killed before the rename cannot produce one) are skipped.
    """
    found = []
    for child in root.iterdir() if root.is_dir() else ():
        if step_of(child) is not None and child.is_dir():
            try:
                json.loads((child / MANIFEST).read_text())
            except (OSError, ValueError):
                continue
            found.append((step_of(child), child))
    return sorted(found)


def read_manifest(path: Path) -> dict:
    """The manifest of the checkpoint folder ``path``; ConfigError naming the problem when it is not one."""
    if not path.is_dir():
        what = "is not a folder" if path.exists() else "does not exist"
        raise ConfigError(f"checkpoint {str(path)!r} {what}")
    if path.name.endswith(".tmp") or not (path / MANIFEST).exists():
        why = "a .tmp folder" if path.name.endswith(".tmp") else f"no {MANIFEST}"
        raise ConfigError(f"checkpoint {str(path)!r} is incomplete ({why}: its save did not finish); resume "
                          f"from a complete global_step_N folder")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        if manifest.get("format") != FORMAT:
            raise ValueError(f"format is {manifest.get('format')!r}, expected {FORMAT!r}")
        for key in ("step", "world_size", "files", "roles", "model_shapes"):
            if key not in manifest:
                raise ValueError(f"key {key!r} is missing")
    except (OSError, ValueError, AttributeError) as err:
        raise ConfigError(f"checkpoint {str(path)!r} has a corrupt {MANIFEST} ({err})") from err
    return manifest


def verify_checkpoint(path: Path) -> dict:
    """Manifest of ``path`` after checking that every file it lists exists with its recorded size."""
    manifest = read_manifest(path)
    for rel, size in manifest["files"].items():
        f = path / rel
        if not f.is_file():
            raise ConfigError(f"checkpoint {str(path)!r} is corrupt: {rel} is missing")
        if f.stat().st_size != size:
            raise ConfigError(f"checkpoint {str(path)!r} is corrupt: {rel} has {f.stat().st_size} bytes, "
                              f"the manifest says {size}")
    return manifest


def resolve_resume(spec: str, out_dir: Path) -> Optional[Path]:
    """The checkpoint folder ``trainer.resume`` names, or None for a fresh start.

    ``auto``: the newest complete checkpoint under ``{out_dir}/checkpoints`` (none: fresh).
    ``off``: fresh. A path: a ``global_step_N`` folder, or a folder holding such folders
    (its newest complete one). Raises ConfigError for anything else.
    """
    if spec == "off":
        return None
    if spec == "auto":
        found = complete_checkpoints(out_dir / CHECKPOINTS)
        return found[-1][1] if found else None
    path = Path(spec)
    if not path.exists():
        raise ConfigError(f"trainer.resume is {spec!r}, which does not exist; use auto, off or a "
                          f"checkpoint folder")
    is_holder = step_of(path) is None and not path.name.endswith(".tmp") and not (path / MANIFEST).exists()
    if path.is_dir() and is_holder:
        found = complete_checkpoints(path / CHECKPOINTS if (path / CHECKPOINTS).is_dir() else path)
        if not found:
            raise ConfigError(f"trainer.resume is {spec!r}, which holds no complete global_step_N checkpoint")
        path = found[-1][1]
    read_manifest(path)
    return path


def write_synced(path: Path, text: str) -> None:
    """Write and fsync, so a rename that follows never exposes an empty file after a crash."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def replace_atomically(path: Path, text: str) -> None:
    """``path`` holds its old text or ``text``, never a part of either (a synced sibling, then a rename)."""
    tmp = path.with_name(path.name + ".tmp")
    write_synced(tmp, text)
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_tree(path: Path) -> None:
    """Rename first, then delete: an interrupted delete leaves a name resume never looks at."""
    doomed = path.with_name(f"{path.name}.deleting")
    if doomed.exists():
        shutil.rmtree(doomed)
    os.rename(path, doomed)
    shutil.rmtree(doomed)
