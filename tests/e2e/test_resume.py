"""Checkpoints end to end: torchrun, 2 CPU ranks, the tiny GRPO config.

Runs (each a torchrun of ``python -m spmdrl.train``), shared by the tests below:

    full       4 steps, checkpoints at 2 and 4, HF export at each save     (the reference)
    stopped    the same, with a SIGTERM on rank 1 at step 1 -> checkpoint at step 2, exit 0
    resumed    a copy of ``stopped``'s folder (what the stop left stays): auto-resume from step 2 to 4
    faulted    SIGKILL of rank 1 after step 3 under --max-restarts 1 -> restart, resume from 2, finish

The signals come from the fault-injection hook (SPMDRL_FAULT_INJECT_*), so the
step at which they land is deterministic. The first three are in the shared jobs
(tests/e2e/shared_runs.py); ``faulted`` needs torchrun's restart, a job of its own.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, read_metrics, train
from shared_runs import declare

pytestmark = pytest.mark.e2e

ARGS = [
    "--config", "configs/grpo.yaml", "--trainer.total_steps", "4", "--data.train_batch_size", "4",
    "--rollout.n", "2", "--actor.ppo_mini_batch_size", "4", "--data.max_response_length", "8",
    "--trainer.save_freq", "2", "--trainer.progress_bar", "false",
]
# Wall time and memory change from run to run; everything else must not.
VOLATILE = ("timing/", "memory/", "perf/")


def torchrun(out: Path, cache: str, *extra: str, env: dict | None = None, restarts: int = 0,
             log: str = "") -> subprocess.CompletedProcess:
    proc = train([*ARGS, "--trainer.output_dir", str(out), *extra], cache=cache, nproc=2, env=env,
                 check=False, extra_torchrun=["--max-restarts", str(restarts)])
    (out.parent / f"{log or out.name}.log").write_text(proc.stdout + proc.stderr)
    return proc


def metrics(out: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in read_metrics(out)]


def final_params(out: Path, step: int = 4) -> dict[str, torch.Tensor]:
    from spmdrl.export import read_model_state

    return read_model_state(out / "checkpoints" / f"global_step_{step}")


declare("resume/full", [*ARGS, "--trainer.output_dir", "{base}/resume/full", "--trainer.export_hf_on_save",
                       "true"])
declare("resume/stopped", [*ARGS, "--trainer.output_dir", "{base}/resume/stopped"],
        env={"SPMDRL_FAULT_INJECT_STEP": "1", "SPMDRL_FAULT_INJECT_SIGNAL": "SIGTERM"})
declare("resume/resumed", [*ARGS, "--trainer.output_dir", "{base}/resume/resumed"],
        copy=("{base}/resume/stopped", "{base}/resume/resumed"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, spmdrl_cache: str, shared) -> dict[str, Path]:
    out = {name: shared.path(f"resume/{name}") for name in ("full", "stopped", "resumed")}
    for name in out:
        shared.ran(f"resume/{name}")
    procs = {"stopped_state": {  # what the stopped run left
        "checkpoints": sorted(p.name for p in (out["stopped"] / "checkpoints").iterdir()),
        "latest": (out["stopped"] / "checkpoints" / "latest").read_text().strip()
        if (out["stopped"] / "checkpoints" / "latest").exists() else None,
        "steps": [row["step"] for row in metrics(out["stopped"])],
    }, "stopped_stderr": shared.stderr("resume/stopped"), "resumed_stdout": shared.stdout("resume/resumed"),
        "resumed_stderr": shared.stderr("resume/resumed")}
    out["faulted"] = tmp_path_factory.mktemp("resume") / "faulted"
    # torchrun's restart reuses its shared TCPStore, whose stale keys from the killed attempt can point
    # the new ranks at dead peers (pytorch/pytorch#135712); a store per attempt avoids that.
    restart_env = {"SPMDRL_FAULT_INJECT_STEP": "3", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    procs["faulted"] = torchrun(out["faulted"], spmdrl_cache, env=restart_env, restarts=1)
    assert procs["faulted"].returncode == 0, f"faulted run failed:\n{procs['faulted'].stderr[-4000:]}"
    return {**out, "procs": procs}


def test_sigterm_checkpoints_at_next_boundary_and_exits_0(runs):
    state = runs["procs"]["stopped_state"]
    assert state["checkpoints"] == ["global_step_2", "latest"]
    assert state["latest"] == "global_step_2"
    assert state["steps"] == [1, 2]
    assert "SIGTERM: checkpoint and stop" in runs["procs"]["stopped_stderr"]


def test_resume_reproduces_metrics_and_params_exactly(runs):
    assert "resumed from" in runs["procs"]["resumed_stdout"]
    full, resumed = metrics(runs["full"]), metrics(runs["resumed"])
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert resumed == full
    a, b = final_params(runs["full"]), final_params(runs["resumed"])
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_sigkill_restart_resumes_to_the_same_params(runs):
    log = runs["procs"]["faulted"].stdout + runs["procs"]["faulted"].stderr
    assert "resumed from" in log and "global_step_2" in log
    assert [r["step"] for r in metrics(runs["faulted"])] == [1, 2, 3, 4]
    assert metrics(runs["faulted"]) == metrics(runs["full"])
    a, b = final_params(runs["full"]), final_params(runs["faulted"])
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_each_run_releases_the_output_folder_and_a_resume_keeps_its_files_in_place(runs):
    # SIGTERM's checkpoint-and-stop exits through the normal path, so the resumed run found no lock to take
    # over; a restart after SIGKILL found its killed attempt's lock free; every finished run left none.
    assert "took over" not in runs["procs"]["resumed_stderr"]
    for name in ("full", "stopped", "resumed", "faulted"):
        assert not (runs[name] / "spmdrl.lock").exists(), name
        assert not (runs[name] / "previous").exists(), name  # resumed in place: nothing set aside


def test_export_loads_in_transformers_with_the_actors_logits(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    ckpt = runs["full"] / "checkpoints" / "global_step_4"
    out = tmp_path / "hf"
    cmd = [sys.executable, "-m", "spmdrl.export", "--checkpoint", str(runs["full"]), "--out", str(out),
           "--max-shard-size", "4MB"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (out / "model.safetensors.index.json").exists()
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    offline = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    live = AutoModelForCausalLM.from_pretrained(ckpt / "hf", dtype=torch.float32)  # export_hf_on_save
    live_params = dict(live.named_parameters())
    for name, p in offline.named_parameters():
        assert torch.equal(p, live_params[name]), name
    ids = torch.randint(3, offline.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(offline(ids).logits, live(ids).logits)
    # The exported weights are the trained ones, not the initial model's.
    trained = final_params(runs["full"])
    assert torch.equal(offline.get_input_embeddings().weight, trained["model.embed_tokens.weight"])
