"""Megatron checkpoints export offline: ``spmdrl.export`` in this process (no process group, megatron-core
blocked) turns a checkpoint the CheckpointManager saved from a 2-rank Megatron actor, at tp=2 and at pp=2,
into the tensors the live engine's ``export_weights()`` gave, in a folder transformers loads.

One 2-rank spawn trains each layout one GRPO step, saves it and writes the live export to a file; it then
resumes the tp2 checkpoint into an actor configured with another lr, betas and weight decay.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import spawn

pytestmark = pytest.mark.dist

pytest.importorskip("megatron.core")

# after the skip: test_megatron needs megatron-core too
from test_megatron import LR, N, make_batch  # noqa: E402

LAYOUTS = {"tp2": dict(tp=2, pp=1), "pp2": dict(tp=1, pp=2)}


def _save(rank: int, world: int, model_dir: str, base: str) -> None:
    from transformers import AutoTokenizer

    from spmdrl.checkpoint.manager import CheckpointManager
    from spmdrl.config import Config
    from spmdrl.engines.megatron.engine import MegatronEngine
    from spmdrl.objectives import actor_loss_fn
    from spmdrl.parallel import ParallelDims

    cfg = Config()
    cfg.model.path = model_dir
    mine = make_batch(2048).select(slice(rank * N // 2, (rank + 1) * N // 2))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    live = {}
    for name, layout in LAYOUTS.items():
        eng = MegatronEngine(model_dir, role="actor", dims=ParallelDims(world, **layout).build(), lr=LR,
                             seed=0)
        # not the HF weights
        eng.train_step(mine, actor_loss_fn(cfg), mini_batch_size=N // 2, micro_batch_size=2)
        CheckpointManager(Path(base) / name, {"actor": eng}, cfg=cfg, total_steps=1,
                          tokenizer=tokenizer).save(1)
        live[name] = {k: v.clone() for k, v in eng.export_weights()}
        del eng
    if rank == 0:  # a file, not the result queue: whole tensors would clog its pipe
        torch.save(live, Path(base) / "live.pt")
    # tp2's checkpoint resumed by an actor configured with another lr, betas and weight decay.
    eng = MegatronEngine(model_dir, role="actor", dims=ParallelDims(world, **LAYOUTS["tp2"]).build(),
                         lr=LR / 2, betas=(0.8, 0.95), weight_decay=0.1, seed=0)
    cfg.trainer.resume = str(Path(base) / "tp2" / "checkpoints" / "global_step_1")
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        CheckpointManager(Path(base) / "tp2_resumed", {"actor": eng}, cfg=cfg, total_steps=1,
                          tokenizer=tokenizer).resume()
    if rank == 0:
        groups = [{k: g[k] for k in ("lr", "betas", "weight_decay")} for g in eng.optimizer.param_groups]
        (Path(base) / "resumed.json").write_text(json.dumps({"groups": groups, "log": log.getvalue()}))


@pytest.fixture(scope="module")
def saved(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    base = tmp_path_factory.mktemp("megatron_export")
    spawn(_save, 2, str(tiny_model_dir), str(base))
    return base, torch.load(base / "live.pt")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_megatron_checkpoint_exports_offline_as_the_live_engine(saved, layout, tmp_path, monkeypatch):
    import torch.distributed as dist
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from spmdrl.export import export_checkpoint, parse_size

    base, live = saved
    manifest = json.loads((base / layout / "checkpoints" / "global_step_1" / "manifest.json").read_text())
    assert manifest["strategies"] == {"actor": "megatron"}
    with monkeypatch.context() as blocked:  # the reader must not need megatron-core
        for module in ("megatron", "megatron.core"):
            blocked.setitem(sys.modules, module, None)
        out = export_checkpoint(base / layout, tmp_path / "hf", parse_size("6MB"))  # a run folder: its newest
    assert not dist.is_initialized()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    exported = {k: v for f in sorted(set(index["weight_map"].values()))
                for k, v in load_file(out / f).items()}
    assert sorted(exported) == sorted(live[layout])  # the tied lm_head left out by both
    for name, tensor in live[layout].items():
        assert torch.equal(exported[name], tensor), name
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    params = dict(model.named_parameters())
    for name, tensor in live[layout].items():
        assert torch.equal(params[name], tensor), name


def test_megatron_resume_applies_the_configured_optimizer(saved):
    base, _ = saved
    resumed = json.loads((base / "resumed.json").read_text())
    decay, no_decay = resumed["groups"]
    assert decay["lr"] == no_decay["lr"] == LR / 2  # the constant schedule's lr at step 1: the configured one
    assert decay["betas"] == no_decay["betas"] == [0.8, 0.95]  # (JSON makes the tuple a list)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert f"[checkpoint] actor.lr: {LR} in the checkpoint -> {LR / 2} configured" in resumed["log"]
