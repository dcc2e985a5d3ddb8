"""Where checkpoints live and whether one is complete: folder names, the manifest, resume resolution, and the
fsync / atomic-replace / rename-then-delete helpers that keep a killed save from looking finished.

    {output_dir}/checkpoints/global_step_N/manifest.json     written last (see manager.py for the folder):
                                                         every file's size and sha256
    {output_dir}/checkpoints/latest                          names the newest complete one

A folder counts as a checkpoint only when its name is ``global_step_N`` and
its manifest parses; ``*.tmp`` (a save in progress or killed), ``*.deleting``
and ``*.superseded`` never do.
"""

from __future__ import annotations

import hashlib
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
DIGESTS = "sha256"  # manifest key: file -> sha256 of its content (absent in manifests before it)
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def step_of(path: Path) -> Optional[int]:
    return int(m.group(1)) if (m := _STEP_DIR.match(path.name)) else None


def step_folders(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every ``global_step_N`` folder under ``root``, complete or not, oldest first."""
    return sorted((step_of(c), c) for c in (root.iterdir() if root.is_dir() else ())
                  if step_of(c) is not None and c.is_dir())


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint under ``root``, oldest first.

    ``*.tmp`` (a save in progress or killed) and folders without a parsable
    manifest (a save killed before the rename cannot produce one) are skipped.
    """
    found = []
    for step, child in step_folders(root):
        try:
            json.loads((child / MANIFEST).read_text())
        except (OSError, ValueError):
            continue
        found.append((step, child))
    return found


def file_digest(path: Path) -> str:
    """sha256 of a file, read in chunks (hashlib releases the GIL while it hashes)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _confined(path: Path, rel: object, key: str) -> Path:
    """``path / rel`` when it stays inside the checkpoint folder ``path`` (symbolic links resolved)."""
    target = path / rel if isinstance(rel, str) and rel and not Path(rel).is_absolute() else None
    if target is None or ".." in Path(rel).parts or not target.resolve().is_relative_to(path.resolve()):
        raise ConfigError(f"checkpoint {str(path)!r} is refused: {MANIFEST} {key} names {rel!r}, which is "
                          f"not inside the checkpoint folder (an absolute path, '..' or a symbolic link out)")
    return target


def read_manifest(path: Path) -> dict:
    """The manifest of the checkpoint folder ``path``; ConfigError naming the problem when it is not one, or
    when a path it names (``files``, ``model_files``) leads outside the folder."""
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
        if not isinstance(manifest["files"], dict) or not isinstance(manifest.get(DIGESTS, {}), dict):
            raise ValueError(f"files and {DIGESTS} must map file names to values")
    except (OSError, ValueError, AttributeError) as err:
        raise ConfigError(f"checkpoint {str(path)!r} has a corrupt {MANIFEST} ({err})") from err
    for rel in [*manifest["files"], *manifest.get(DIGESTS, {})]:
        _confined(path, rel, "files")
    if "model_files" in manifest:
        _confined(path, manifest["model_files"], "model_files")
    return manifest


def verify_checkpoint(path: Path, digests: bool = True) -> dict:
    """Manifest of ``path`` after checking that no symbolic link in it leads out of it, and that every file
    it lists exists with its recorded size and (with ``digests``, for manifests that record them) sha256."""
    manifest = read_manifest(path)
    root = path.resolve()
    for p in path.rglob("*"):  # a file loaded without being listed must not lead elsewhere either
        if p.is_symlink() and not p.resolve().is_relative_to(root):
            raise ConfigError(f"checkpoint {str(path)!r} is refused: {p.relative_to(path)} is a symbolic "
                              f"link out of the checkpoint folder")
    for rel, size in manifest["files"].items():
        f = path / rel
        if not f.is_file():
            raise ConfigError(f"checkpoint {str(path)!r} is corrupt: {rel} is missing")
        if f.stat().st_size != size:
            raise ConfigError(f"checkpoint {str(path)!r} is corrupt: {rel} has {f.stat().st_size} bytes, "
                              f"the manifest says {size}")
    for rel, digest in manifest.get(DIGESTS, {}).items() if digests else ():
        if not (path / rel).is_file() or file_digest(path / rel) != digest:
            raise ConfigError(f"checkpoint {str(path)!r} is corrupt: the content of {rel} is not what was "
                              f"saved (its sha256 differs from the manifest's)")
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
    verify_checkpoint(path, digests=False)  # sizes: cheap; the contents are hashed where it is loaded
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
