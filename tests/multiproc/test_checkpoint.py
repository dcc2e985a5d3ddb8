"""CheckpointManager on gloo: 2-rank save -> 1-rank resume, keep_last, atomicity, bad checkpoints, export.

Two spawns serve every test: a 2-rank run that trains the tiny actor and saves
steps 1..3 (keep_last 2), and a 1-rank run that resumes it (another world
size) and then tries every kind of bad checkpoint. The tests compare what they
returned; the export test loads the saved checkpoint in this process.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

import numpy as np
import pytest
import torch
from dist_utils import spawn
from rows import fsdp2_engine
from test_fsdp2 import N, make_batch, pg_loss

pytestmark = pytest.mark.dist


class Position:
    """Stands in for the prompt loader: only its resumable position matters here."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


def _run(model_dir: str, out: str, seed: int = 0, optim: Optional[dict] = None, **trainer) -> SimpleNamespace:
    """A ``CheckpointManager`` (``ckpt``) over a real FSDP2 actor (AdamW lr 1e-3 unless ``optim`` says
    otherwise), a data position, a KL controller and the RNG streams (``actor``, ``train_loader``,
    ``kl_ctrl``, ``rollout``: the parts, as the loop names them)."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from spmdrl.algos.kl import build_kl_controller
    from spmdrl.checkpoint.manager import CheckpointManager
    from spmdrl.checkpoint.rng import RNGState
    from spmdrl.config import Config
    from spmdrl.parallel import ParallelDims

    cfg = Config()
    cfg.model.path = model_dir
    for key, value in {"save_freq": 1, "keep_last": 2, **trainer}.items():
        setattr(cfg.trainer, key, value)
    dims = ParallelDims(dist.get_world_size()).build()
    actor = fsdp2_engine(model_dir, dims=dims, **{"lr": 1e-3, **(optim or {})})
    rollout = SimpleNamespace(generator=torch.Generator().manual_seed(100 + seed + dist.get_rank()))
    parts = {"actor": actor, "data": Position(), "kl_ctrl": build_kl_controller("adaptive", 0.1, 0.05, 100),
             "rng": RNGState(rollout, torch.device("cpu"), cfg.trainer.seed)}
    ckpt = CheckpointManager(Path(out), parts, cfg=cfg, total_steps=10,
                             tokenizer=AutoTokenizer.from_pretrained(model_dir))
    return SimpleNamespace(cfg=cfg, ckpt=ckpt, actor=actor, train_loader=parts["data"],
                           kl_ctrl=parts["kl_ctrl"], rollout=rollout)


def digest(t: torch.Tensor) -> str:
    """Bitwise identity of a tensor in a few bytes (whole tensors would clog the result pipe)."""
    data = t.detach().contiguous().numpy().tobytes()
    return f"{t.dtype}{list(t.shape)}:{hashlib.sha256(data).hexdigest()}"


def _params(engine) -> dict[str, str]:
    return {k: digest(v) for k, v in engine.export_weights()}


def _optim(engine) -> dict[str, str]:
    out = {}
    for name, p in engine.model.named_parameters():
        for key, v in engine.optimizer.state[p].items():
            out[f"{name}/{key}"] = digest(v.full_tensor() if hasattr(v, "full_tensor") else v)
    return out


def _save_steps(rank: int, world: int, model_dir: str, out: str) -> dict:
    r = _run(model_dir, out)
    ckpt = r.ckpt
    fresh = ckpt.resume()
    batch = make_batch(2048)
    mine = batch.select(slice(rank * N // world, (rank + 1) * N // world))
    for step in (1, 2, 3):
        r.actor.train_step(mine, pg_loss, mini_batch_size=N // world, micro_batch_size=4)
        r.kl_ctrl.update(0.2, n_steps=8)
        torch.rand(3, generator=r.rollout.generator)  # the rollout's draws of this step
        r.train_loader.position = step
        ckpt.save(step)
    logp = r.actor.forward_no_grad(mine, micro_batch_size=4)["logp"]
    root = Path(out) / "checkpoints"
    return {
        "fresh": fresh, "listing": sorted(p.name for p in root.iterdir()),
        "latest": (root / "latest").read_text(), "params": _params(r.actor), "optim": _optim(r.actor),
        "sched": r.actor.scheduler.state_dict()["last_epoch"], "kl": r.kl_ctrl.value, "logp": logp.numpy(),
    }


def _resume_and_bad_inputs(rank: int, world: int, model_dir: str, out: str, other_model: str,
                           bad: dict) -> dict:
    from spmdrl.errors import ConfigError

    r = _run(model_dir, out, seed=7)
    ckpt = r.ckpt
    path, log = _printed(ckpt.resume)  # auto: newest complete, on a world size other than the one that saved
    result = {
        "path": str(path), "log": log, "step": ckpt.resumed_step, "position": r.train_loader.position,
        "kl": r.kl_ctrl.value, "params": _params(r.actor), "optim": _optim(r.actor),
        "sched": r.actor.scheduler.state_dict()["last_epoch"], "engine_step": r.actor.global_step,
        "errors": {},
    }
    cases = dict(bad)
    other = _run(other_model, out)
    for name, spec in cases.items():
        target = other if name == "incompatible" else _run(model_dir, out)
        target.cfg.trainer.resume = spec
        try:
            target.ckpt.resume()
            result["errors"][name] = None
        except ConfigError as err:
            result["errors"][name] = str(err)
    # Resume an older step while a later checkpoint exists: the later one belongs to an abandoned run.
    copy = Path(out).with_name("run_older")  # hard links: the saves below only add and remove files
    shutil.copytree(out, copy, copy_function=os.link)
    root = copy / "checkpoints"
    shutil.copytree(root / "global_step_3", root / "global_step_5", copy_function=os.link)
    older = _run(model_dir, str(copy), resume=str(root / "global_step_2"))
    ckpt = older.ckpt
    ckpt.resume()
    ckpt.save(3)
    result["after_older_resume"] = {
        "listing": sorted(p.name for p in root.iterdir()), "latest": (root / "latest").read_text().strip(),
        "world_size_3": json.loads((root / "global_step_3" / "manifest.json").read_text())["world_size"],
    }
    result["fallback"] = _auto_skips_a_corrupt_newest(model_dir, out)
    result["changed_optim"] = _resume_with_changed_optimizer(model_dir, out)
    return result


def _printed(fn: Callable[[], Any]) -> tuple[Any, str]:
    """``fn()`` and what it printed (rank 0's ``[checkpoint]`` lines)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        value = fn()
    return value, buf.getvalue()


def _auto_skips_a_corrupt_newest(model_dir: str, out: str) -> dict:
    """Step 3's shard gets a same-size corruption (one flipped byte): auto resumes step 2 and says why."""
    copy = Path(out).with_name("run_corrupt_newest")
    shutil.copytree(out, copy, copy_function=os.link)
    shard = copy / "checkpoints" / "global_step_3" / "actor" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.unlink()  # a fresh inode: the good checkpoint shares the old one
    shard.write_bytes(bytes(data))
    r = _run(model_dir, str(copy))
    path, log = _printed(r.ckpt.resume)
    return {"path": str(path), "step": r.ckpt.resumed_step, "log": log}


def _resume_with_changed_optimizer(model_dir: str, out: str) -> dict:
    """Resume step 3 (saved with lr 1e-3, betas (0.9, 0.999), no weight decay) into an actor configured
    otherwise: the configured values win, each change is printed once."""
    r = _run(model_dir, out, optim=dict(lr=5e-4, betas=(0.8, 0.95), weight_decay=0.1),
             resume=str(Path(out) / "checkpoints" / "global_step_3"))
    _, log = _printed(r.ckpt.resume)
    groups = [{k: v for k, v in g.items() if k in ("lr", "initial_lr", "betas", "weight_decay")}
              for g in r.actor.optimizer.param_groups]
    return {"groups": groups, "last_lr": r.actor.scheduler.get_last_lr(), "log": log,
            "base_lrs": r.actor.scheduler.base_lrs, "engine_step": r.actor.global_step}


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def _bad_copies(ckpt: Path, base: Path) -> dict[str, str]:
    """Broken copies of a good checkpoint (hard links for the unchanged files)."""

    def copy(name: str) -> Path:
        dst = base / name / "global_step_3"
        shutil.copytree(ckpt, dst, copy_function=os.link)
        return dst

    def rewrite(path: Path, data: bytes) -> None:
        path.unlink()  # a fresh inode: the good checkpoint shares the old one
        path.write_bytes(data)

    truncated = copy("truncated")
    shard = truncated / "actor" / "__1_0.distcp"
    rewrite(shard, shard.read_bytes()[: shard.stat().st_size // 2])
    manifest = copy("bad_manifest") / "manifest.json"
    rewrite(manifest, manifest.read_bytes()[:-10])
    metadata = copy("bad_metadata") / "actor" / ".metadata"  # same size, not DCP metadata: refused unpickling
    evil = b"cos\nsystem\n(S'true'\ntR."  # pickle for os.system("true"): must be refused, not run
    rewrite(metadata, evil + b"." * (metadata.stat().st_size - len(evil)))
    # Whoever plants it also records its digest in the manifest, so it reaches the unpickler.
    planted = json.loads((metadata.parent.parent / "manifest.json").read_text())
    planted["sha256"]["actor/.metadata"] = hashlib.sha256(metadata.read_bytes()).hexdigest()
    rewrite(metadata.parent.parent / "manifest.json", json.dumps(planted).encode())
    flipped = copy("same_size") / "actor" / "__1_0.distcp"
    data = bytearray(flipped.read_bytes())
    data[-100] ^= 0xFF
    rewrite(flipped, bytes(data))
    no_manifest = copy("no_manifest")
    (no_manifest / "manifest.json").unlink()
    tmp = copy("tmp").with_name("global_step_3.tmp")
    os.rename(tmp.with_name("global_step_3"), tmp)
    return {
        "missing": str(base / "nowhere"), "truncated": str(truncated), "bad_manifest": str(manifest.parent),
        "bad_metadata": str(metadata.parent.parent), "no_manifest": str(no_manifest), "tmp": str(tmp),
        "same_size": str(flipped.parent.parent),
        "incompatible": str(ckpt),
    }


def _other_model(tiny: Path, out: Path) -> str:
    """The tiny model with a narrower MLP: same names, other shapes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny)
    config.intermediate_size = 512
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("generation_config.json", "chat_template.jinja"):
            shutil.copyfile(f, out / f.name)
    return str(out)


@pytest.fixture(scope="module")
def results(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("checkpoint")
    out = base / "run"
    saved = spawn(_save_steps, 2, str(tiny_model_dir), str(out))
    root = out / "checkpoints"
    # Leftovers a resume must ignore: a killed save (.tmp, even with a manifest) and an unrenamed folder.
    shutil.copytree(root / "global_step_3", root / "global_step_9.tmp")
    (root / "global_step_8").mkdir()
    bad = _bad_copies(root / "global_step_3", base / "bad")
    before = _tree(base)
    resumed = spawn(_resume_and_bad_inputs, 1, str(tiny_model_dir), str(out),
                    _other_model(tiny_model_dir, base / "other"), bad)[0]
    after = _tree(base)
    changed = sorted(k for k in before if k.startswith("bad/") and after.get(k) != before[k])
    return {"saved": saved, "resumed": resumed, "root": root, "bad_changed": changed}


def test_keep_last_and_latest(results):
    saved = results["saved"][0]
    assert saved["fresh"] is None
    assert saved["listing"] == ["global_step_2", "global_step_3", "latest"]
    assert saved["latest"].strip() == "global_step_3"
    manifest = json.loads((results["root"] / "global_step_3" / "manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["world_size"] == 2 and manifest["roles"] == ["actor"]
    assert {"rng_rank0.pt", "rng_rank1.pt", "trainer_state.json", "config.yaml"} <= set(manifest["files"])
    # every file's sha256, the big ones hashed by the rank that wrote them
    assert sorted(manifest["sha256"]) == sorted(manifest["files"])
    for rel in ("actor/__1_0.distcp", "rng_rank1.pt", "actor/.metadata", "config.yaml"):
        data = (results["root"] / "global_step_3" / rel).read_bytes()
        assert manifest["sha256"][rel] == hashlib.sha256(data).hexdigest(), rel


def test_two_rank_save_resumes_on_one_rank_exactly(results):
    saved, resumed = results["saved"][0], results["resumed"]
    assert resumed["path"].endswith("global_step_3")  # not the .tmp of step 9 nor the manifest-less step 8
    assert (resumed["step"], resumed["position"], resumed["engine_step"], resumed["sched"]) == (3, 3, 3, 3)
    assert resumed["kl"] == saved["kl"]
    for part in ("params", "optim"):
        assert sorted(resumed[part]) == sorted(saved[part])
        assert resumed[part] == saved[part]


def test_resuming_an_older_step_sets_later_checkpoints_aside(results):
    # The stale .tmp is gone, the manifest-less step 8 is not a checkpoint and stays; step 3 was rewritten.
    assert results["resumed"]["after_older_resume"] == {
        "listing": ["global_step_2", "global_step_3", "global_step_5.superseded", "global_step_8", "latest"],
        "latest": "global_step_3", "world_size_3": 1,
    }


def test_bad_checkpoints_fail_with_one_sentence_and_touch_nothing(results):
    errors = results["resumed"]["errors"]
    expected = {
        "missing": "which does not exist",
        "truncated": "is corrupt: actor/__1_0.distcp has",
        "bad_manifest": "has a corrupt manifest.json",
        "bad_metadata": "could not be loaded (actor/.metadata: os.system is not allowed in checkpoint "
                        "metadata)",
        "same_size": "is corrupt: the content of actor/__1_0.distcp is not what was saved (its sha256 "
                     "differs",
        "no_manifest": "is incomplete (no manifest.json",
        "tmp": "is incomplete (a .tmp folder",
        "incompatible": "is incompatible: actor weight model.layers.0.mlp.down_proj.weight has shape "
                        "[256, 1024] there and [256, 512] in this run's model",
    }
    for case, text in expected.items():
        assert errors[case] is not None and text in errors[case], (case, errors[case])
        assert "\n" not in errors[case]
    assert results["bad_changed"] == []


def test_export_matches_the_trained_actor(results, tmp_path):
    from transformers import AutoModelForCausalLM

    from spmdrl.export import export_checkpoint, parse_size

    out = export_checkpoint(results["root"] / "global_step_3", tmp_path / "hf", parse_size("6MB"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and "lm_head.weight" not in index["weight_map"]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert {name: digest(p) for name, p in model.named_parameters()} == results["saved"][0]["params"]
    batch = make_batch(2048)
    with torch.no_grad():  # positions P-1 .. P+R-2 predict the R response tokens
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits[:, -6:-1]  # [N, R, V]
    resp = batch["input_ids"][:, -5:]
    logp = logits.gather(-1, resp.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)  # [N, R]
    trained = np.concatenate([r["logp"] for r in results["saved"]])
    np.testing.assert_allclose(logp.numpy(), trained, rtol=0, atol=1e-5)


def test_auto_resume_skips_a_corrupt_newest_checkpoint_and_says_why(results):
    fallback = results["resumed"]["fallback"]
    assert fallback["path"].endswith("run_corrupt_newest/checkpoints/global_step_2") and fallback["step"] == 2
    skipped = [line for line in fallback["log"].splitlines() if "skips" in line]
    assert len(skipped) == 2  # newest first: the manifest-less step 8 the fixture left, then step 3
    assert skipped[0].startswith("[checkpoint] trainer.resume=auto skips global_step_8: checkpoint ")
    assert "is incomplete (no manifest.json" in skipped[0]
    assert skipped[1].startswith("[checkpoint] trainer.resume=auto skips global_step_3: checkpoint ")
    assert "is corrupt: the content of actor/__0_0.distcp is not what was saved" in skipped[1]


def test_resume_applies_the_configured_optimizer_and_says_what_changed(results):
    changed = results["resumed"]["changed_optim"]
    decay, no_decay = changed["groups"]
    assert decay["betas"] == no_decay["betas"] == (0.8, 0.95)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)  # 1-D weights never decay
    assert decay["initial_lr"] == no_decay["initial_lr"] == 5e-4 and changed["base_lrs"] == [5e-4, 5e-4]
    # the constant schedule at step 3: the configured lr itself, also what the scheduler reports
    assert decay["lr"] == no_decay["lr"] == 5e-4 and changed["last_lr"] == [5e-4, 5e-4]
    assert changed["engine_step"] == 3  # the moments and step stay the checkpoint's
    lines = [line for line in changed["log"].splitlines() if "configured" in line]
    assert sorted(lines) == [
        "[checkpoint] actor.betas: (0.9, 0.999) in the checkpoint -> (0.8, 0.95) configured",
        "[checkpoint] actor.lr: 0.001 in the checkpoint -> 0.0005 configured",
        "[checkpoint] actor.weight_decay: 0.0 in the checkpoint -> 0.1 configured",
    ]
    assert "in the checkpoint ->" not in results["resumed"]["log"]  # an unchanged config says nothing
