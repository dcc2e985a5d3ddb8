"""Loading a checkpoint runs nothing from its files and reads nothing outside its folder.

Every payload is built here, in front of (or in place of) the genuine bytes of a DCP folder this test
saves, and each would run its command under plain ``pickle`` (checked once): the safe loader must refuse
it with one sentence naming the file, and the marker file the command would create must not exist.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata

from spmdrl.checkpoint.layout import FORMAT, MANIFEST, resolve_resume, verify_checkpoint
from spmdrl.checkpoint.safe_load import load_state, read_metadata
from spmdrl.errors import ConfigError


def _global(module: str, name: str) -> bytes:
    """Protocol-4 STACK_GLOBAL of ``module`` / ``name`` (the name may be dotted, as pickle allows)."""
    def text(s: str) -> bytes:
        data = s.encode()
        return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE

    return text(module) + text(name) + b"\x93"


def _call(module: str, name: str, *args: str | bytes) -> bytes:
    """Pickle ops that call ``module.name(*args)`` and drop the result (the genuine pickle follows)."""
    def arg(a: str | bytes) -> bytes:
        data = a.encode() if isinstance(a, str) else a
        opcode = b"X" if isinstance(a, str) else b"B"  # BINUNICODE, BINBYTES
        return opcode + len(data).to_bytes(4, "little") + data

    return _global(module, name) + b"(" + b"".join(map(arg, args)) + b"tR0"  # MARK args TUPLE REDUCE POP


def _prefixed(payload: bytes, genuine: bytes) -> bytes:
    return b"\x80\x04" + payload + genuine


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A checkpoint-like folder ``global_step_1/actor`` holding a genuine DCP save of two tensors and a
    non-tensor item, as the engines save them."""
    folder = tmp_path / "global_step_1" / "actor"
    state = {"model": {"w": torch.arange(12.0).view(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)},
             "optim": {"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999)}]}, "step": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving in one process"
        dcp.save(state, checkpoint_id=str(folder))
    return folder


def _template() -> dict:
    return {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16)},
            "optim": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0)}]}, "step": 0}


def _load(folder: Path) -> str:
    with pytest.raises(ConfigError) as err, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_state(_template(), folder)
    text = str(err.value)
    assert "\n" not in text and f"({folder.name}/.metadata: " in text and str(folder.parent) in text
    return text


def test_genuine_folder_loads(ckpt: Path):
    state = _template()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_state(state, ckpt)
    assert torch.equal(state["model"]["w"], torch.arange(12.0).view(3, 4)) and state["step"] == 3
    assert state["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)


GADGETS = {
    # name: (payload that calls the command, the refusal)
    "os.system": (lambda cmd: _call("os", "system", cmd), "os.system is not allowed"),
    "dotted name through an allowed module": (
        lambda cmd: _call("torch.distributed.checkpoint.metadata", "os.system", cmd),
        "torch.distributed.checkpoint.metadata.os.system is not allowed"),
    "pickle.loads through an allowed module": (
        lambda cmd: _call("torch.distributed.checkpoint.filesystem", "pickle.loads",
                          _prefixed(_call("os", "system", cmd), b"N.")),
        "torch.distributed.checkpoint.filesystem.pickle.loads is not allowed"),
    "builtins.eval": (lambda cmd: _call("builtins", "eval", f"__import__('os').system({cmd!r})"),
                      "builtins.eval is not allowed"),
    "getattr chain": (lambda cmd: _global("builtins", "getattr") + _global("torch", "Size")
                      + b"X\x09\x00\x00\x00__class__\x86R0", "builtins.getattr is not allowed"),
    "attribute of an allowed class": (  # the module's globals (os, torch, ...) as a dict
        lambda cmd: _global("torch.distributed.checkpoint.metadata", "Metadata.__init__.__globals__") + b"0",
        "torch.distributed.checkpoint.metadata.Metadata.__init__.__globals__ is not allowed"),
}


@pytest.mark.parametrize("name", list(GADGETS))
def test_metadata_gadgets_are_refused_and_run_nothing(ckpt: Path, tmp_path: Path, name: str):
    payload, refusal = GADGETS[name]
    genuine = (ckpt / ".metadata").read_bytes()
    marker = tmp_path / "ran"
    evil = _prefixed(payload(f"touch {marker}"), genuine)
    if name not in ("getattr chain", "attribute of an allowed class"):  # those only reach, they call nothing
        assert isinstance(pickle.loads(evil), dcp_metadata.Metadata) and marker.exists()  # a real gadget
        marker.unlink()
    (ckpt / ".metadata").write_bytes(evil)
    assert f"{refusal} in checkpoint metadata)" in _load(ckpt)
    assert not marker.exists()


def test_allowed_callable_with_a_hostile_argument_is_refused(ckpt: Path):
    genuine = (ckpt / ".metadata").read_bytes()
    hostile = _call("torch.serialization", "_get_layout", "os.system")
    (ckpt / ".metadata").write_bytes(_prefixed(hostile, genuine))
    assert "not DCP metadata (KeyError" in _load(ckpt)


def test_changing_an_allowed_class_is_undone_and_refused(ckpt: Path):
    # BUILD on the class itself with slot state: setattr(Metadata, "planted", "x") for the whole process.
    genuine = (ckpt / ".metadata").read_bytes()
    build = _global("torch.distributed.checkpoint.metadata", "Metadata") + b"N}X\x07\x00\x00\x00plantedX" \
        b"\x01\x00\x00\x00xs\x86b0"
    (ckpt / ".metadata").write_bytes(_prefixed(build, genuine))
    assert "a change to the class Metadata is not allowed" in _load(ckpt)
    assert not hasattr(dcp_metadata.Metadata, "planted")


def _rewrite_storage(folder: Path, relative_path: str) -> None:
    """The genuine metadata with every data file renamed (a trusted round trip: the test wrote it)."""
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = relative_path
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("where", ["absolute", "dotdot", "symlink"])
def test_metadata_cannot_point_at_files_outside_its_folder(ckpt: Path, tmp_path: Path, where: str):
    outside = tmp_path / "secret.distcp"
    data = next(ckpt.glob("*.distcp"))
    outside.write_bytes(data.read_bytes())
    name = {"absolute": str(outside), "dotdot": "../../secret.distcp", "symlink": "link.distcp"}[where]
    if where == "symlink":
        (ckpt / "link.distcp").symlink_to(outside)
    _rewrite_storage(ckpt, name)
    assert f"the data file {name!r} is not a file in its folder" in _load(ckpt)


def test_metadata_that_is_a_symlink_out_is_refused(ckpt: Path, tmp_path: Path):
    os.replace(ckpt / ".metadata", tmp_path / "elsewhere")
    (ckpt / ".metadata").symlink_to(tmp_path / "elsewhere")
    assert "a symbolic link out of its folder is not allowed" in _load(ckpt)
    with pytest.raises(ConfigError, match="not allowed"):
        read_metadata(ckpt)


# -- the manifest


def _checkpoint(tmp_path: Path, ckpt: Path) -> Path:
    """A minimal complete checkpoint around ``ckpt`` (global_step_1) with sizes and sha256 of every file."""
    root = ckpt.parent
    (root / "model_files").mkdir()
    (root / "model_files" / "config.json").write_text("{}")
    files = [p for p in sorted(root.rglob("*")) if p.is_file()]
    manifest = {
        "format": FORMAT, "step": 1, "world_size": 1, "roles": ["actor"], "model_shapes": {"actor": {}},
        "files": {str(p.relative_to(root)): p.stat().st_size for p in files},
        "sha256": {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files},
        "model_files": "model_files",
    }
    (root / MANIFEST).write_text(json.dumps(manifest))
    return root


def _edit_manifest(root: Path, **changes) -> None:
    manifest = json.loads((root / MANIFEST).read_text())
    for key, fn in changes.items():
        manifest[key] = fn(manifest[key])
    (root / MANIFEST).write_text(json.dumps(manifest))


def test_a_genuine_checkpoint_verifies(tmp_path: Path, ckpt: Path):
    root = _checkpoint(tmp_path, ckpt)
    assert verify_checkpoint(root)["step"] == 1
    assert resolve_resume(str(root), tmp_path) == root


@pytest.mark.parametrize("key,bad", [
    ("files", "/etc/passwd"), ("files", "../../outside"), ("files", "actor/../../outside"),
    ("sha256", "/etc/passwd"), ("model_files", "/etc"), ("model_files", ".."),
])
def test_manifest_paths_must_stay_inside(tmp_path: Path, ckpt: Path, key: str, bad: str):
    root = _checkpoint(tmp_path, ckpt)
    if key == "model_files":
        _edit_manifest(root, model_files=lambda _: bad)
    else:
        _edit_manifest(root, **{key: lambda files: {**files, bad: 1}})
    with pytest.raises(ConfigError) as err:
        resolve_resume(str(root), tmp_path)  # the check run before any process group exists
    assert f"{MANIFEST} {key.replace('sha256', 'files')} names {bad!r}, which is not inside the checkpoint " \
           f"folder" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("listed", [True, False])
def test_symlinks_out_of_the_checkpoint_are_refused(tmp_path: Path, ckpt: Path, listed: bool):
    root = _checkpoint(tmp_path, ckpt)
    (tmp_path / "secret").write_text("x" * 10)
    (root / "model_files" / "tokenizer.json").symlink_to(tmp_path / "secret")
    if listed:  # an attacker who lists it with the right size and digest
        digest = hashlib.sha256(b"x" * 10).hexdigest()
        _edit_manifest(root, files=lambda f: {**f, "model_files/tokenizer.json": 10},
                       sha256=lambda f: {**f, "model_files/tokenizer.json": digest})
    with pytest.raises(ConfigError, match="model_files/tokenizer.json"):
        verify_checkpoint(root)


def test_same_size_corruption_fails_the_digest(tmp_path: Path, ckpt: Path):
    root = _checkpoint(tmp_path, ckpt)
    data = next(ckpt.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte: the size still matches
    data.write_bytes(bytes(raw))
    resolve_resume(str(root), tmp_path)  # sizes only: passes
    with pytest.raises(ConfigError) as err:
        verify_checkpoint(root)
    assert f"is corrupt: the content of actor/{data.name} is not what was saved" in str(err.value)
