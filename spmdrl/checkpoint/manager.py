"""The checkpoint manager: atomic saves of a dict of stateful parts, exact resume, keep-last pruning.

    parts = {"actor": actor, "critic": critic, "data": loader, "kl_ctrl": kl_ctrl, "rng": RNGState(...)}
    ckpt = CheckpointManager(out_dir, parts, cfg=cfg, total_steps=steps, tokenizer=tokenizer)
    if ckpt.resume(): step = ckpt.resumed_step      # trainer.resume: auto | off | PATH
    ...after each step: if ckpt.due(step) or stop: ckpt.save(step)

A part is anything with ``state_dict()`` / ``load_state_dict(state)``. Its class
attribute ``checkpoint_layout`` says how it is stored, so a new part (a LoRA
adapter, a replay buffer) checkpoints without a change here:

    "sharded"    a torch.distributed.checkpoint folder named after the part, saved and loaded
                 collectively and reshardable (the engines). The shapes of its ``model`` state go into
                 the manifest, and so does its ``strategy`` (the engine format: "fsdp2", "megatron"),
                 which tells ``spmdrl.export`` whose reader turns the folder into Hugging Face tensors.
    "per_rank"   ``{name}_rank{r}.pt`` on each rank, loaded weights-only; resumed on another world size,
                 the part's ``reseed(step, rank)`` runs instead (the RNG streams, ``rng.RNGState``).
    "shared"     the default: small JSON state in trainer_state.json, written by rank 0 (data-loader
                 position, KL controller).
    "files"      a folder named after the part that rank 0 writes with ``save_files(folder)`` and every
                 rank reads with ``load_files(folder)`` (split placement's batch in flight: safetensors and
                 JSON).

One checkpoint is a folder ``{output_dir}/checkpoints/global_step_N/`` (names: ``layout.py``):

    manifest.json        written last: step, world size, parts and their layouts, every file with its size
                         and sha256, model shapes and strategy of each sharded part
    config.yaml          the resolved config of the run that saved it
    trainer_state.json   the step and the shared parts
    actor/ critic/       the sharded parts: model, optimizer, LR schedule, engine step
    rng_rank{r}.pt       the per-rank part "rng": torch (CPU, CUDA), python, numpy, rollout sampling generator
    model_files/         config.json, generation_config.json and tokenizer files (for spmdrl.export)
    hf/                  with trainer.export_hf_on_save: a Hugging Face folder of the actor

Atomicity: everything is written under ``global_step_N.tmp/``; after every rank
has finished, rank 0 writes the manifest, renames the folder into place and
then updates ``latest`` (tmp file + os.replace). A save killed at any point
leaves nothing resume would pick. Old checkpoints (beyond ``trainer.keep_last``)
are renamed away before they are deleted. Resuming verifies every file's size
and sha256; ``auto`` passes over a checkpoint that fails (saying which and why)
to the newest one that verifies, a named checkpoint that fails is an error.

Loading never runs arbitrary pickle (``safe_load.py``); the per-rank files load
weights-only and the rest is JSON.

Exactness: a run resumed on the same world size continues bit for bit (CPU,
fixed seed). On another world size the parameters and optimizer are resharded
exactly and the rollouts draw the samples the uninterrupted run would have drawn:
their noise is keyed by (seed, step, prompt id, sample, position), not by rank
(``rollout/sampling.py``; vLLM with rollout.seed_mode per_response). The per-rank
streams left (torch's, Python's, a per_engine library engine's) are reseeded from
(seed, step, rank).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import torch
import torch.distributed as dist

from spmdrl import __version__
from spmdrl.checkpoint.in_flight import InFlight
from spmdrl.checkpoint.layout import (
    CHECKPOINTS,
    DIGESTS,
    FORMAT,
    LATEST,
    MANIFEST,
    complete_checkpoints,
    file_digest,
    fsync_dir,
    remove_tree,
    replace_atomically,
    resolve_resume,
    step_folders,
    verify_checkpoint,
    write_synced,
)
from spmdrl.checkpoint.safe_load import load_state, save_state
from spmdrl.config import dump_config
from spmdrl.errors import ConfigError

if TYPE_CHECKING:
    from spmdrl.config import Config

log = logging.getLogger("spmdrl")

LAYOUTS = ("sharded", "per_rank", "shared", "files")
SHARED_STATE = "trainer_state.json"


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def layout_of(part: Any) -> str:
    """How ``part`` is stored: its ``checkpoint_layout``, "shared" (JSON in trainer_state.json) by default."""
    return getattr(part, "checkpoint_layout", "shared")


def _model_shapes(model_state: dict) -> dict[str, list[int]]:
    return {k: list(v.shape) for k, v in sorted(model_state.items()) if isinstance(v, torch.Tensor)}


class CheckpointManager:
    """Saves and restores one run's parts; every method is collective (call it on every rank)."""

    def __init__(self, out_dir: Path, parts: dict[str, Stateful], *, cfg: "Config", total_steps: int,
                 tokenizer: Any, config_text: Optional[str] = None,
                 group: Optional[dist.ProcessGroup] = None) -> None:
        """``cfg`` with ``builtin:`` paths resolved (its model folder's config and generation config are
        copied into each checkpoint); ``config_text``: the config as the user gave it (default: ``cfg``);
        ``group``: the ranks that save (a CPU group whose rank 0 is the world's; default the world: under
        split placement the training ranks, spmdrl/split/)."""
        for name, part in parts.items():
            if layout_of(part) not in LAYOUTS:
                raise ValueError(f"checkpoint part {name!r} has checkpoint_layout {layout_of(part)!r}; "
                                 f"valid: {', '.join(LAYOUTS)}")
        if "step" in parts:
            raise ValueError("checkpoint part name 'step' is taken: trainer_state.json keeps the step there")
        self.parts = parts
        self.cfg = cfg
        self.config_text = dump_config(cfg) if config_text is None else config_text
        self.out_dir = out_dir
        self.total_steps = total_steps
        self.tokenizer = tokenizer  # saved next to the weights so export needs nothing else
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.resumed_step = 0  # set by resume()
        self.root = out_dir / CHECKPOINTS
        self.model_src = Path(cfg.model.path)
        # Object collectives (decisions, error messages) need a CPU group; NCCL has none of its own.
        if group is None and dist.get_backend() != "gloo":
            group = dist.new_group(backend="gloo")
        self._pg = group

    def _named(self, layout: str) -> dict[str, Any]:
        return {name: part for name, part in self.parts.items() if layout_of(part) == layout}

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

    def _all_shapes(self, model_state: dict) -> dict[str, list[int]]:
        """Weight shapes of the whole model: the union over ranks (a pipeline stage or TP rank of the
        Megatron engine holds only its own weights; FSDP2 ranks hold the same global DTensor shapes)."""
        shards: list = [None] * self.world_size
        dist.all_gather_object(shards, _model_shapes(model_state), group=self._pg)
        return dict(sorted((k, v) for shard in shards for k, v in shard.items()))

    # -- saving

    def due(self, step: int, last: bool = False) -> bool:
        """Save every ``trainer.save_freq`` steps and at the last step (``total_steps``, or ``last``: the
        run ends early), never when save_freq is -1."""
        freq = self.cfg.trainer.save_freq
        return freq > 0 and (step % freq == 0 or step == self.total_steps or last)

    def save(self, step: int) -> Path:
        """Write ``global_step_{step}``; returns its folder once it is complete and ``latest`` names it."""
        start = time.perf_counter()
        final = self.root / f"global_step_{step}"
        tmp = final.with_name(final.name + ".tmp")
        self._from_rank0(lambda: self._prepare(tmp))
        shapes = {}
        for name, part in self._named("sharded").items():
            state = part.state_dict()
            shapes[name] = self._all_shapes(state.get("model", {}))
            save_state(state, tmp / name, self._pg)
        error, own = None, {}
        try:
            for name, part in self._named("per_rank").items():
                torch.save(part.state_dict(), tmp / f"{name}_rank{self.rank}.pt")
            own = self._own_digests(tmp)
        except OSError as err:
            error = str(err)
        self._all_ok(error, RuntimeError)
        shares: list = [None] * self.world_size
        dist.all_gather_object(shares, own, group=self._pg)
        digests = {rel: digest for share in shares for rel, digest in share.items()}
        if self.cfg.trainer.export_hf_on_save:
            self._export_hf(tmp)
        nbytes = self._from_rank0(lambda: self._finish(tmp, final, step, shapes, digests))  # also the barrier
        self._say(f"saved {final} ({nbytes / 2**20:.1f} MiB) in {time.perf_counter() - start:.2f} s")
        return final

    def _prepare(self, tmp: Path) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # a save of this step that was killed
            shutil.rmtree(tmp)
        tmp.mkdir()

    def _own_digests(self, tmp: Path) -> dict[str, str]:
        """sha256 of the big files this rank wrote, so that every rank hashes its share at once: its DCP data
        files (``__{rank}_{i}.distcp``) and per-rank files. Rank 0 hashes the rest in ``_finish``."""
        mine = [p for name in self._named("sharded")
                for p in sorted((tmp / name).glob(f"__{self.rank}_*.distcp"))]
        mine += [tmp / f"{name}_rank{self.rank}.pt" for name in self._named("per_rank")]
        return {str(p.relative_to(tmp)): file_digest(p) for p in mine}

    def _finish(self, tmp: Path, final: Path, step: int, shapes: dict[str, dict[str, list[int]]],
                digests: dict[str, str]) -> int:
        """Rank 0, after every rank wrote its files: the small files, the manifest (with the ``digests`` the
        ranks computed, and the missing ones), the rename, ``latest``."""
        files_dir = self._write_model_files(tmp)
        for name, part in self._named("files").items():
            (tmp / name).mkdir()
            part.save_files(tmp / name)
        shared = {"step": step, **{name: part.state_dict() for name, part in self._named("shared").items()}}
        write_synced(tmp / SHARED_STATE, json.dumps(shared, indent=1))
        write_synced(tmp / "config.yaml", self.config_text)
        paths = [p for p in sorted(tmp.rglob("*")) if p.is_file()]
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in paths}
        manifest = {
            "format": FORMAT, "step": step, "world_size": self.world_size, "roles": sorted(shapes),
            "dtype": self.cfg.model.dtype, "model_shapes": shapes, "files": files,
            DIGESTS: {rel: digests.get(rel) or file_digest(tmp / rel) for rel in files},
            "model_files": files_dir.name, "parts": {name: layout_of(p) for name, p in self.parts.items()},
            # The engine format of each sharded part: spmdrl.export picks its reader by it.
            "strategies": {name: getattr(p, "strategy", None) for name, p in self._named("sharded").items()},
            # The folder the run's weights started from (builtin: and relative paths resolved): a LoRA
            # export names it as the adapters' base (spmdrl.export).
            "base_model": str(self.model_src.resolve()),
            "spmdrl_version": __version__, "torch_version": torch.__version__, "created_unix": time.time(),
        }
        write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1))
        fsync_dir(tmp)
        if final.exists():  # saved before by a run that was resumed from an older step
            remove_tree(final)
        os.rename(tmp, final)
        fsync_dir(self.root)
        replace_atomically(self.root / LATEST, final.name + "\n")
        fsync_dir(self.root)
        try:
            self._prune(step)
        except OSError as err:  # the new checkpoint is complete; old ones only cost disk
            self._say(f"could not delete old checkpoints ({err}); training goes on")
        return sum(files.values())

    def _export_hf(self, tmp: Path) -> None:
        """The live actor as a Hugging Face folder ``hf/``: every rank gathers, rank 0 writes."""
        from spmdrl.checkpoint.hf_folder import write_hf_folder

        weights = self.parts["actor"].export_weights()
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
        for name in ("config.json", "generation_config.json"):
            if (self.model_src / name).is_file():
                shutil.copyfile(self.model_src / name, out / name)
        self.tokenizer.save_pretrained(str(out))
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
        for path in older[: max(0, len(older) - (self.cfg.trainer.keep_last - 1))]:
            remove_tree(path)
        for child in self.root.iterdir():
            if child.is_dir() and child.name.endswith((".tmp", ".deleting")):
                shutil.rmtree(child, ignore_errors=True)

    # -- resuming

    def resume(self) -> Optional[Path]:
        """Restore the checkpoint ``trainer.resume`` names; returns its folder (``resumed_step`` is its step),
        or None on a fresh start. The rollout engine still holds the initial weights afterwards."""
        spec = self.cfg.trainer.resume
        path, manifest = self._from_rank0(lambda: self._choose(spec))
        if path is None:
            self._say(f"no checkpoint to resume from (trainer.resume={spec}): starting at step 0")
            return None
        start = time.perf_counter()
        path = Path(path)
        sharded = self._named("sharded")
        states = {name: part.state_dict() for name, part in sharded.items()}
        live = {name: self._all_shapes(state.get("model", {})) for name, state in states.items()}
        self._check_compatible(path, manifest, live)
        for name, part in sharded.items():
            load_state(states[name], path / name, self._pg)
            part.load_state_dict(states[name])
        error = None
        try:
            self._load_local(path, manifest["world_size"])
        except Exception as err:  # a bad file must stop every rank with the same sentence
            error = f"checkpoint {str(path)!r} could not be loaded ({type(err).__name__}: {err})"
        self._all_ok(error, ConfigError)
        if manifest["world_size"] != self.world_size and not self._keyed_sampling():
            log.warning("resumed a %d-rank checkpoint on %d ranks: parameters are exact, rollout samples are "
                        "not those of an uninterrupted run (rollout.seed_mode per_engine: per-rank streams)",
                        manifest["world_size"], self.world_size)
        self._say(f"resumed from {path} at step {self.resumed_step} in {time.perf_counter() - start:.2f} s")
        return path

    def _keyed_sampling(self) -> bool:
        from spmdrl.rollout import rollout_engine_class

        return rollout_engine_class(self.cfg.rollout.engine).keyed_sampling(self.cfg)

    def _load_local(self, path: Path, saved_world_size: int) -> None:
        """The shared parts and this rank's per-rank parts (reseeded when the world size changed)."""
        shared = json.loads((path / SHARED_STATE).read_text())
        for name, part in self._named("shared").items():
            part.load_state_dict(shared[name])
        self.resumed_step = step = int(shared["step"])
        for name, part in self._named("files").items():
            part.load_files(path / name)
        for name, part in self._named("per_rank").items():
            if saved_world_size == self.world_size:
                part.load_state_dict(torch.load(path / f"{name}_rank{self.rank}.pt", weights_only=True))
            else:
                part.reseed(step, self.rank)

    def _choose(self, spec: str) -> tuple[Optional[str], Optional[dict]]:
        """Rank 0: the checkpoint to resume and its verified manifest. ``auto`` passes over checkpoints that
        fail verification (newest first), saying which and why; a named one must verify."""
        path = resolve_resume(spec, self.out_dir)
        if path is None:
            return None, None
        if spec == "auto":
            return self._newest_verified(path.parent)
        try:
            return str(path), verify_checkpoint(path)
        except ConfigError as err:
            older = [p for s, p in complete_checkpoints(path.parent) if p != path]
            hint = f"; set trainer.resume to an older one ({older[-1]}) or move it away" if older else ""
            raise ConfigError(f"{err}{hint}") from err

    def _newest_verified(self, root: Path) -> tuple[str, dict]:
        skipped = []
        for _, path in reversed(step_folders(root)):  # a folder whose manifest does not parse is said too
            try:
                return str(path), verify_checkpoint(path)
            except ConfigError as err:
                skipped.append(path.name)
                self._say(f"trainer.resume=auto skips {path.name}: {err}")
        raise ConfigError(f"trainer.resume is auto but no checkpoint under {str(root)!r} verifies "
                          f"({', '.join(skipped)}: see above); move them away to start afresh, or set "
                          f"trainer.resume to a checkpoint")

    def _check_compatible(self, path: Path, manifest: dict, live: dict[str, dict[str, list[int]]]) -> None:
        held = InFlight.saved_steps(path / "in_flight") if "in_flight" not in self.parts else []
        if held:  # a colocated run would load the data position after them and never train them
            raise ConfigError(
                f"checkpoint {str(path)!r} was saved by a split placement run with the batches of steps "
                f"{', '.join(map(str, held))} in flight, which a colocated run cannot train; resume it with "
                f"rollout.placement split (its config.yaml), or from a checkpoint that holds none"
            )
        if sorted(live) != sorted(manifest["roles"]):
            raise ConfigError(
                f"checkpoint {str(path)!r} holds {', '.join(manifest['roles'])} but this run trains "
                f"{', '.join(sorted(live))}; resume with the algorithm that saved it (its config.yaml)"
            )
        for role in live:
            saved = manifest.get("strategies", {}).get(role)  # absent in manifests older than the key
            mine = getattr(self.parts[role], "strategy", None)
            if saved is not None and saved != mine:
                raise ConfigError(f"checkpoint {str(path)!r} holds a {saved} {role} but this run's "
                                  f"actor.strategy is {mine}; resume with the strategy that saved it")
        for role, shapes in live.items():
            saved = manifest["model_shapes"][role]
            for name in sorted(set(shapes) | set(saved)):
                if shapes.get(name) != saved.get(name):
                    raise ConfigError(
                        f"checkpoint {str(path)!r} is incompatible: {role} weight {name} has shape "
                        f"{saved.get(name)} there and {shapes.get(name)} in this run's model; resume "
                        f"with the model.path that saved it"
                    )
