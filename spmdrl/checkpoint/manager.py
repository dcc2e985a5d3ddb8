"""Checkpoints: atomic sharded saves, exact resume, preemption signals and a fault-injection test hook.

    ckpt = Checkpointer(RunState(cfg, out_dir, engines, rollout, loader, kl_ctrl, tokenizer, device, steps))
    if ckpt.resume(): step = ckpt.resumed_step   # trainer.resume: auto | off | PATH
    ...after each step: stop = ckpt.stop_requested(step); if ckpt.due(step) or stop: ckpt.save(step)

One checkpoint is a folder ``{output_dir}/checkpoints/global_step_N/``:

    manifest.json        written last: step, world size, every file with its size, model shapes
    config.yaml          the resolved config of the run that saved it
    trainer_state.json   step, data-loader position, KL controller
    actor/ critic/       torch.distributed.checkpoint folders: model, optimizer, LR schedule, engine step
                         (sharded; loadable on another world size)
    rng_rank{r}.pt       rank r's RNG states: torch (CPU, CUDA), python, numpy, rollout sampling generator
    model_files/         config.json, generation_config.json and tokenizer files (for spmdrl.export)
    hf/                  with trainer.export_hf_on_save: a Hugging Face folder of the actor

Atomicity: everything is written under ``global_step_N.tmp/``; after every rank
has finished, rank 0 writes the manifest, renames the folder into place and
then updates ``latest`` (tmp file + os.replace). A folder counts as a
checkpoint only when its name is ``global_step_N`` and its manifest parses, so
a save killed at any point leaves nothing resume would pick. Old checkpoints
(beyond ``trainer.keep_last``) are renamed away before they are deleted.

Loading never runs arbitrary pickle: DCP's ``.metadata`` goes through an
unpickler that only builds DCP's metadata classes; tensors, DCP's non-tensor
items and the RNG files load with ``torch.load(weights_only=True)``; the rest is JSON.

Exactness: a run resumed on the same world size continues bit for bit (CPU,
fixed seed). On another world size the parameters and optimizer are resharded
exactly, but rollout sampling streams are per rank, so each rank's generator
is reseeded from (seed, step, rank) and the samples drawn from then on differ
from the uninterrupted run's.

Test hook: ``SPMDRL_FAULT_INJECT_STEP=N`` makes rank ``SPMDRL_FAULT_INJECT_RANK``
(default 1) send itself ``SPMDRL_FAULT_INJECT_SIGNAL`` (default SIGKILL) at the end
of step N, after the stop check, on torchrun's first attempt only. With SIGTERM the
stop is seen at the next boundary, as for a signal that lands mid-step.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner.load_bytes uses
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from spmdrl import __version__
from spmdrl.config import dump_config
from spmdrl.errors import ConfigError
from spmdrl.checkpoint.rng import reseed_rng, rng_state, set_rng_state
from spmdrl.builtin.models import resolve_builtin_model

if TYPE_CHECKING:
    from spmdrl.config import Config

log = logging.getLogger("spmdrl")

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT = "spmdrl-checkpoint/1"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


# ----------------------------------------------------------------------------- safe DCP reading


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


# ----------------------------------------------------------------------------- finding and checking


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


# ----------------------------------------------------------------------------- small files


def _write_text(path: Path, text: str) -> None:
    """Write and fsync, so a rename that follows never exposes an empty file after a crash."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_tree(path: Path) -> None:
    """Rename first, then delete: an interrupted delete leaves a name resume never looks at."""
    doomed = path.with_name(f"{path.name}.deleting")
    if doomed.exists():
        shutil.rmtree(doomed)
    os.rename(path, doomed)
    shutil.rmtree(doomed)


def _model_shapes(model_state: dict) -> dict[str, list[int]]:
    return {k: list(v.shape) for k, v in sorted(model_state.items()) if isinstance(v, torch.Tensor)}


def trim_metrics(path: Path, last_step: int) -> None:
    """Drop metric rows after ``last_step`` (they will be logged again) and a half-written last line."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if int(json.loads(line)["step"]) <= last_step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    tmp = path.with_name(path.name + ".tmp")
    _write_text(tmp, "".join(f"{line}\n" for line in kept))
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- the checkpointer


@dataclass
class RunState:
    """What a checkpoint saves and restores: the trained engines and the stateful pieces around them."""

    cfg: "Config"
    out_dir: Path  # the run's output folder (checkpoints/ goes under it)
    engines: dict[str, Any]  # role ("actor", "critic") -> engine with state_dict / load_state_dict
    rollout: Any  # its sampling generator is part of the RNG state
    loader: Any  # state_dict / load_state_dict: the data position
    kl_ctrl: Any  # state_dict / load_state_dict
    tokenizer: Any  # saved next to the weights so export needs nothing else
    device: torch.device
    total_steps: int


class Checkpointer:
    """Saves and restores one run's state; every method is collective (call it on every rank)."""

    def __init__(self, r: RunState, install_signal_handlers: bool = True) -> None:
        self.r = r
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.resumed_step = 0  # set by resume()
        self.root = r.out_dir / CHECKPOINTS
        # Collective (rank 0 may build a builtin model): resolved here, where every rank passes.
        self.model_src = Path(resolve_builtin_model(r.cfg.model.path))
        self._signal: Optional[int] = None
        # Object collectives (decisions, error messages) need a CPU group; NCCL has none of its own.
        self._pg = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
        if install_signal_handlers and threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                signal.signal(sig, self._on_signal)

    # -- signals

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only a flag: the step finishes, then every rank agrees to save and stop (stop_requested).
        if self._signal is None:  # os.write: print/logging may not be re-entered from a handler
            name = signal.Signals(signum).name
            os.write(2, f"[rank {self.rank}] {name}: checkpoint and stop at the end of this step\n".encode())
        self._signal = signum

    def stop_requested(self, step: int) -> bool:
        """True on every rank when any rank got SIGTERM/SIGUSR1 (an all-reduce at the boundary after ``step``)."""
        flag = torch.tensor([0 if self._signal is None else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._pg)
        self._maybe_inject_fault(step)
        return bool(flag.item())

    def _maybe_inject_fault(self, current: int) -> None:
        step = os.environ.get("SPMDRL_FAULT_INJECT_STEP")
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if step is None or int(step) != current or not first_attempt:
            return
        rank = int(os.environ.get("SPMDRL_FAULT_INJECT_RANK", min(1, self.world_size - 1)))
        if rank == self.rank:
            sig = signal.Signals[os.environ.get("SPMDRL_FAULT_INJECT_SIGNAL", "SIGKILL")]
            log.warning("SPMDRL_FAULT_INJECT_STEP=%s: rank %d sends itself %s", step, rank, sig.name)
            os.kill(os.getpid(), sig)

    def _say(self, text: str) -> None:
        if self.rank == 0:
            print(f"[checkpoint] {text}", flush=True)

    # -- collectives that keep every rank on the same decision

    def _from_rank0(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on rank 0 only; every rank returns its result or raises its error (no rank hangs)."""
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box[0] = ("ok", fn())
            except ConfigError as err:
                box[0] = ("config", str(err))
            except Exception as err:  # any failure must reach the other ranks, which wait on this broadcast
                box[0] = ("error", f"{type(err).__name__}: {err}")
        dist.broadcast_object_list(box, src=0, group=self._pg)
        kind, value = box[0]
        if kind == "config":
            raise ConfigError(value)
        if kind == "error":
            raise RuntimeError(f"rank 0: {value}")
        return value

    def _all_ok(self, error: Optional[str], make: Callable[[str], Exception]) -> None:
        """Raise on every rank when any rank failed locally (first failing rank's message)."""
        errors: list[Optional[str]] = [None] * self.world_size
        dist.all_gather_object(errors, error, group=self._pg)
        bad = [(i, e) for i, e in enumerate(errors) if e is not None]
        if bad:
            raise make(f"rank {bad[0][0]}: {bad[0][1]}")

    # -- saving

    def due(self, step: int) -> bool:
        """Save every ``trainer.save_freq`` steps and at the last step (never when save_freq is -1)."""
        freq = self.r.cfg.trainer.save_freq
        return freq > 0 and (step % freq == 0 or step == self.r.total_steps)

    def _engines(self) -> dict[str, Any]:
        return self.r.engines

    def _all_shapes(self, model_state: dict) -> dict[str, list[int]]:
        """Weight shapes of the whole model: the union over ranks (a pipeline stage or TP rank of the
        Megatron engine holds only its own weights; FSDP2 ranks hold the same global DTensor shapes)."""
        parts: list = [None] * self.world_size
        dist.all_gather_object(parts, _model_shapes(model_state), group=self._pg)
        return dict(sorted((k, v) for part in parts for k, v in part.items()))

    def save(self, step: int) -> Path:
        """Write ``global_step_{step}``; returns its folder once it is complete and ``latest`` names it."""
        start = time.perf_counter()
        r = self.r
        final = self.root / f"global_step_{step}"
        tmp = final.with_name(final.name + ".tmp")

        def prepare() -> None:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():  # a save of this step that was killed
                shutil.rmtree(tmp)
            tmp.mkdir()

        self._from_rank0(prepare)
        shapes = {}
        for role, engine in self._engines().items():
            state = engine.state_dict()
            shapes[role] = self._all_shapes(state["model"])
            save_state(state, tmp / role, self._pg)
        error = None
        try:
            torch.save(rng_state(r.rollout, r.device), tmp / f"rng_rank{self.rank}.pt")
        except OSError as err:
            error = str(err)
        self._all_ok(error, RuntimeError)
        if r.cfg.trainer.export_hf_on_save:
            self._export_hf(tmp)

        def finish() -> int:
            files_dir = self._write_model_files(tmp)
            state = {"step": step, "data": r.loader.state_dict(), "kl_ctrl": r.kl_ctrl.state_dict()}
            _write_text(tmp / "trainer_state.json", json.dumps(state, indent=1))
            _write_text(tmp / "config.yaml", dump_config(r.cfg))
            files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
            manifest = {
                "format": FORMAT, "step": step, "world_size": self.world_size, "roles": sorted(shapes),
                "dtype": r.cfg.model.dtype, "model_shapes": shapes, "files": files,
                "model_files": files_dir.name, "spmdrl_version": __version__,
                "torch_version": torch.__version__, "created_unix": time.time(),
            }
            _write_text(tmp / MANIFEST, json.dumps(manifest, indent=1))
            _fsync_dir(tmp)
            if final.exists():  # saved before by a run that was resumed from an older step
                _remove_tree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            _write_text(self.root / f"{LATEST}.tmp", final.name + "\n")
            os.replace(self.root / f"{LATEST}.tmp", self.root / LATEST)
            _fsync_dir(self.root)
            try:
                self._prune(step)
            except OSError as err:  # the new checkpoint is complete; old ones only cost disk
                self._say(f"could not delete old checkpoints ({err}); training goes on")
            return sum(files.values())

        nbytes = self._from_rank0(finish)  # also the barrier: nobody leaves before the rename
        self._say(f"saved {final} ({nbytes / 2**20:.1f} MiB) in {time.perf_counter() - start:.2f} s")
        return final

    def _export_hf(self, tmp: Path) -> None:
        """The live actor as a Hugging Face folder ``hf/``: every rank gathers, rank 0 writes."""
        from spmdrl.checkpoint.hf_folder import write_hf_folder

        weights = self.r.engines["actor"].export_weights()
        error = None
        if self.rank == 0:
            try:
                write_hf_folder(weights, tmp / "hf", self._write_model_files(tmp))
            except Exception as err:  # the other ranks are still gathering: finish the stream, then fail
                error = f"{type(err).__name__}: {err}"
        for _ in weights:  # every rank takes part in each all-gather
            pass
        self._all_ok(error, RuntimeError)

    def _write_model_files(self, tmp: Path) -> Path:
        """config.json, generation_config.json and the tokenizer: export needs nothing but the checkpoint."""
        out = tmp / "model_files"
        if out.exists():
            return out
        out.mkdir()
        src = self.model_src
        for name in ("config.json", "generation_config.json"):
            if (src / name).is_file():
                shutil.copyfile(src / name, out / name)
        self.r.tokenizer.save_pretrained(str(out))
        return out

    def _prune(self, just_saved: int) -> None:
        """Keep the newest ``keep_last`` complete checkpoints (the one just saved among them).

        Checkpoints of later steps come from a timeline this run abandoned (it
        resumed from an older step): they are renamed ``*.superseded``, so that
        ``auto`` never resumes them, but not deleted. Stale temp folders go.
        """
        older = []
        for step, path in complete_checkpoints(self.root):
            if step > just_saved:
                aside = path.with_name(path.name + ".superseded")
                if aside.exists():
                    shutil.rmtree(aside)
                os.rename(path, aside)
                self._say(f"{path.name} is from a run abandoned at step {just_saved}: renamed {aside.name}")
            elif step < just_saved:
                older.append(path)
        for path in older[: max(0, len(older) - (self.r.cfg.trainer.keep_last - 1))]:
            _remove_tree(path)
        for child in self.root.iterdir():
            if child.is_dir() and child.name.endswith((".tmp", ".deleting")):
                shutil.rmtree(child, ignore_errors=True)

    # -- resuming

    def resume(self) -> Optional[Path]:
        """Restore the checkpoint ``trainer.resume`` names; returns its folder (``resumed_step`` is its step),
        or None on a fresh start. The rollout engine still holds the initial weights afterwards."""
        r = self.r
        spec = r.cfg.trainer.resume
        path, manifest = self._from_rank0(lambda: self._choose(spec))
        if path is None:
            self._from_rank0(lambda: trim_metrics(r.out_dir / "metrics.jsonl", -1))
            self._say(f"no checkpoint to resume from (trainer.resume={spec}): starting at step 0")
            return None
        start = time.perf_counter()
        path = Path(path)
        engines = self._engines()
        states = {role: engine.state_dict() for role, engine in engines.items()}
        self._check_compatible(path, manifest, {k: self._all_shapes(v["model"]) for k, v in states.items()})
        for role, engine in engines.items():
            load_state(states[role], path / role, self._pg)
            engine.load_state_dict(states[role])
        error = None
        try:
            trainer = json.loads((path / "trainer_state.json").read_text())
            r.loader.load_state_dict(trainer["data"])
            r.kl_ctrl.load_state_dict(trainer["kl_ctrl"])
            self.resumed_step = step = int(trainer["step"])
            if manifest["world_size"] == self.world_size:
                rng = torch.load(path / f"rng_rank{self.rank}.pt", weights_only=True)
                set_rng_state(rng, r.rollout, r.device)
            else:
                reseed_rng(r.cfg.trainer.seed, step, self.rank, r.rollout)
        except Exception as err:  # a bad file must stop every rank with the same sentence
            error = f"checkpoint {str(path)!r} could not be loaded ({type(err).__name__}: {err})"
        self._all_ok(error, ConfigError)
        self._from_rank0(lambda: trim_metrics(r.out_dir / "metrics.jsonl", self.resumed_step))
        if manifest["world_size"] != self.world_size:
            log.warning("resumed a %d-rank checkpoint on %d ranks: parameters are exact, rollout samples are "
                        "not those of an uninterrupted run (per-rank sampling streams)",
                        manifest["world_size"], self.world_size)
        self._say(f"resumed from {path} at step {self.resumed_step} in {time.perf_counter() - start:.2f} s")
        return path

    def _choose(self, spec: str) -> tuple[Optional[str], Optional[dict]]:
        path = resolve_resume(spec, self.r.out_dir)
        if path is None:
            return None, None
        try:
            return str(path), verify_checkpoint(path)
        except ConfigError as err:
            older = [p for s, p in complete_checkpoints(path.parent) if p != path]
            hint = f"; set trainer.resume to an older one ({older[-1]}) or move it away" if older else ""
            raise ConfigError(f"{err}{hint}") from err

    def _check_compatible(self, path: Path, manifest: dict, live: dict[str, dict[str, list[int]]]) -> None:
        if sorted(live) != sorted(manifest["roles"]):
            raise ConfigError(
                f"checkpoint {str(path)!r} holds {', '.join(manifest['roles'])} but this run trains "
                f"{', '.join(sorted(live))}; resume with the algorithm that saved it (its config.yaml)"
            )
        for role, shapes in live.items():
            saved = manifest["model_shapes"][role]
            for name in sorted(set(shapes) | set(saved)):
                if shapes.get(name) != saved.get(name):
                    raise ConfigError(
                        f"checkpoint {str(path)!r} is incompatible: {role} weight {name} has shape "
                        f"{saved.get(name)} there and {shapes.get(name)} in this run's model; resume "
                        f"with the model.path that saved it"
                    )
