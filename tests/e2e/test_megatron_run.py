"""``actor.strategy: megatron`` end to end: a 2-rank torchrun GRPO run (actor TP=2, reference, native
rollout with weight sync) takes the steps the FSDP2 engine takes on the same seed, and a run resumed
from its step-1 checkpoint takes the same second step. The 2-rank runs are in the shared 2-rank job, after
its other runs (tests/e2e/shared_runs.py); the split ones (3 ranks, Megatron's groups made afresh) run
alone."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
from conftest import REPO, TINY, read_metrics, train
from shared_runs import declare

pytestmark = pytest.mark.e2e

pytest.importorskip("megatron.core")

STEPS = 2
# Full-length responses (ignore_eos): per-micro-batch metric means then equal batch means, so the two
# engines' different micro-batch cuts (FSDP2: each rank's rows; Megatron TP: the TP group's) report alike.
COMMON = ["--config", "configs/grpo.yaml", *TINY, "--trainer.total_steps", str(STEPS), "--rollout.n", "4",
          "--rollout.ignore_eos", "true", "--actor.param_dtype", "float32", "--rollout.dtype", "float32",
          "--model.fused_kernels", "off"]


MEGATRON = ["--actor.strategy", "megatron", "--parallel.tp", "2"]
SAVES = ["--trainer.export_hf_on_save", "true"]
for _name, _extra in (("fsdp2", [*SAVES, "--trainer.save_freq", "2"]),
                      ("megatron", [*MEGATRON, *SAVES, "--trainer.save_freq", "1"]),
                      ("resumed", [*MEGATRON, "--trainer.resume",
                                   "{base}/megatron/megatron/checkpoints/global_step_1"])):
    declare(f"megatron/{_name}", [*COMMON, *_extra, "--trainer.output_dir", f"{{base}}/megatron/{_name}"],
            late=_name != "fsdp2")
declare("megatron/ppo", ["--config", "configs/ppo.yaml", *TINY, "--trainer.total_steps", str(STEPS),
                         "--actor.strategy", "megatron", "--parallel.pp", "2",
                         "--actor.param_dtype", "float32", "--model.fused_kernels", "off",
                         "--trainer.save_freq", str(STEPS),
                         "--trainer.output_dir", "{base}/megatron/ppo"], late=True)
SPLIT_ARGS = ["--config", "configs/grpo.yaml", *TINY, "--trainer.total_steps", "3", "--rollout.n", "4",
              "--actor.strategy", "megatron", "--parallel.tp", "2", "--actor.param_dtype", "float32",
              "--rollout.dtype", "float32"]
declare("megatron/split_colocated", [*SPLIT_ARGS, "--trainer.output_dir", "{base}/megatron/split_colocated"],
        late=True)


def test_megatron_grpo_matches_fsdp2(tmp_path, shared):
    runs = {name: shared.rows(f"megatron/{name}") for name in ("fsdp2", "megatron", "resumed")}
    assert "tp=1" in shared.stdout("megatron/resumed")  # rank 1 sat on TP coordinate 1 of the megatron run
    base = shared.path("megatron")
    fsdp2, megatron = runs["fsdp2"], runs["megatron"]
    assert len(fsdp2) == len(megatron) == STEPS
    # Step 1 starts from the same weights and samples: the same loss, entropy and gradient norm.
    for key in ("reward/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert math.isclose(megatron[0][key], fsdp2[0][key], rel_tol=1e-4, abs_tol=1e-6), key
    # Step 2 samples from the updated actor (weight sync) and adds the KL to the (megatron) reference.
    for key in ("reward/mean", "actor/entropy", "actor/grad_norm", "actor/kl_loss"):
        assert math.isclose(megatron[1][key], fsdp2[1][key], rel_tol=1e-3), key
    assert megatron[1]["actor/kl_loss"] > 0  # the actor moved away from the reference
    # Resumed on the same ranks: the second step is bitwise the uninterrupted one (CPU, fixed seed).
    resumed = runs["resumed"]
    assert [m["step"] for m in resumed] == [2]
    for key in ("reward/mean", "actor/entropy", "actor/grad_norm", "actor/kl_loss", "actor/lr"):
        assert resumed[0][key] == megatron[1][key], key
    # The Hugging Face folders written at step 2: the same weights, up to float noise next to the step.
    from safetensors.torch import load_file

    hf = {n: load_file(str(base / n / "checkpoints" / "global_step_2" / "hf" / "model.safetensors"))
          for n in ("fsdp2", "megatron")}
    first = load_file(str(base / "megatron" / "checkpoints" / "global_step_1" / "hf" / "model.safetensors"))
    assert sorted(hf["fsdp2"]) == sorted(hf["megatron"])
    norm = lambda a, b: sum(float((a[k] - b[k]).norm() ** 2) for k in a) ** 0.5  # noqa: E731
    assert norm(hf["megatron"], hf["fsdp2"]) < 1e-3 * norm(hf["megatron"], first)
    # spmdrl.export reads the Megatron checkpoint offline (the engine's own reader): the live export's
    # weights.
    done = subprocess.run([sys.executable, "-m", "spmdrl.export", "--checkpoint", str(base / "megatron"),
                           "--out", str(tmp_path / "export")], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]
    offline = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert sorted(offline) == sorted(hf["megatron"])
    for name, tensor in offline.items():
        assert tensor.equal(hf["megatron"][name]), name


def test_megatron_ppo_trains_the_critic(shared):
    """PPO (GAE) with the Megatron actor, reference and critic cut into 2 pipeline stages: the loop's
    critic values feed GAE, the critic's update reports finite metrics, and its checkpoint is written."""
    out_dir, metrics = shared.path("megatron/ppo"), shared.rows("megatron/ppo")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        for key in ("critic/vf_loss", "critic/vpred_mean", "critic/grad_norm", "critic/lr", "actor/pg_loss"):
            assert math.isfinite(m[key]), (key, m[key])
        assert m["critic/grad_norm"] > 0 and m["critic/lr"] > 0
    assert metrics[0]["critic/vpred_mean"] != metrics[1]["critic/vpred_mean"]  # the critic's update moved it
    assert (out_dir / "checkpoints" / f"global_step_{STEPS}" / "critic").is_dir()


def test_megatron_on_split_placement(tmp_path, spmdrl_cache, shared):
    """Megatron trains on split placement's training ranks: its model-parallel groups cover those ranks only
    (TP 2 over ranks 0-1, the rollout on rank 2). Without staleness the run equals the colocated Megatron
    TP 2 run on 2 ranks, the update's metrics bitwise (float32, one thread); a checkpoint holding the batch
    in flight resumes to the same last step."""
    split = ["--rollout.placement", "split", "--rollout.nnodes", "1", "--rollout.n_gpus_per_node", "1",
             "--rollout.max_staleness", "0"]
    saved = tmp_path / "split" / "checkpoints" / "global_step_2"
    runs = {"colocated": shared.rows("megatron/split_colocated")}
    for name, extra in (("split", [*split, "--trainer.save_freq", "2"]),
                        ("resumed", [*split, "--trainer.resume", str(saved)])):
        out = train([*SPLIT_ARGS, *extra, "--trainer.output_dir", str(tmp_path / name)], cache=spmdrl_cache,
                    nproc=3)
        runs[name] = read_metrics(tmp_path / name)
    assert "[rank 2/3] rollout only" in out.stdout
    assert [m["step"] for m in runs["split"]] == [1, 2, 3] and [m["step"] for m in runs["resumed"]] == [3]
    for a, b in zip(runs["colocated"], runs["split"]):
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
            assert b[key] == a[key], (a["step"], key)
        # The colocated run averages two rollout ranks' float32 means: float32 rounding apart.
        for key in ("reward/mean", "response_length/mean"):
            assert math.isclose(b[key], a[key], rel_tol=1e-6), (a["step"], key)
        assert b["async/staleness"] == 0.0
    for key in ("reward/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert runs["resumed"][0][key] == runs["split"][2][key], key
