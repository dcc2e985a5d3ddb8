"""``spmdrl.sft`` end to end on the built-in tiny model and arith_sft data (torchrun, CPU ranks).

Runs shared by the tests (each a few seconds of training):

    full       2 ranks, 4 steps, checkpoints at 2 and 4, val/loss at the end, HF export   (the reference)
    stopped    the same, SIGTERM on rank 1 at step 1 -> checkpoint at step 2 and exit
    resumed    a copy of ``stopped``'s folder, resumed to 4
    one        1 rank, the same 4 steps: the loss is a token mean over the global batch, so it agrees

These, verl's SFT command line, the Megatron pair and the LoRA run are in the shared jobs
(tests/e2e/shared_runs.py); a refused start and a held folder run as processes of their own.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from conftest import read_metrics, train
from shared_runs import declare, prepare

pytestmark = pytest.mark.e2e

BASE = ["--config", "configs/sft.yaml", "--data.train_batch_size", "8",
        "--data.micro_batch_size_per_gpu", "2", "--actor.lr_warmup_steps", "1", "--trainer.test_freq", "-1",
        "--trainer.plot_freq", "4",
        "--trainer.progress_bar", "false", "--actor.param_dtype", "float32", "--model.fused_kernels", "off"]
RUN = [*BASE, "--trainer.total_steps", "4", "--trainer.save_freq", "2"]
VOLATILE = ("timing/", "perf/")


def sft(out, cache, *extra, nproc=2, env=None, check=True):
    return train([*RUN, "--trainer.output_dir", str(out), *extra], cache=cache, nproc=nproc, env=env,
                 check=check, module="spmdrl.sft")


def steady(out) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in read_metrics(out)]


def params(out, step=4) -> dict[str, torch.Tensor]:
    from spmdrl.export import read_model_state

    return read_model_state(out / "checkpoints" / f"global_step_{step}")


def declare_sft(name: str, *extra: str, nproc: int = 2, **kw) -> None:
    declare(f"sft/{name}", [*RUN, "--trainer.output_dir", f"{{base}}/sft/{name}", *extra], nproc=nproc,
            sft=True, **kw)


declare_sft("full")
declare_sft("stopped", env={"SPMDRL_FAULT_INJECT_STEP": "1", "SPMDRL_FAULT_INJECT_SIGNAL": "SIGTERM"})
declare_sft("resumed", copy=("{base}/sft/stopped", "{base}/sft/resumed"))
declare_sft("one", "--trainer.save_freq", "-1", nproc=1)
SHORT = ["--trainer.total_steps", "2", "--trainer.save_freq", "-1", "--data.val_files", "null"]
declare_sft("fsdp2", *SHORT)
if importlib.util.find_spec("megatron") is not None:  # the test skips without it
    declare_sft("megatron", *SHORT, "--actor.strategy", "megatron", "--parallel.tp", "2", late=True)
declare_sft("lora", "--trainer.total_steps", "2", "--trainer.save_freq", "2", "--data.val_files", "null",
            "--model.lora_rank", "8", "--actor.lr", "1e-2", nproc=1)


@prepare
def _verl_data(base) -> None:
    from spmdrl.builtin.models import build_model
    from spmdrl.builtin.tasks import generate_arith_sft, write_parquet

    rows = [{"extra_info": {"question": r["prompt"], "answer": r["response"]}}
            for r in generate_arith_sft("train", 32, 0)]
    (base / "sft").mkdir(exist_ok=True)
    write_parquet(rows, base / "sft" / "verl_train.parquet")
    build_model(base / "sft" / "tiny", "tiny", seed=0)


declare("sft/verl", [
    "data.train_files={base}/sft/verl_train.parquet", "data.val_files={base}/sft/verl_train.parquet",
    "data.prompt_key=extra_info", "data.response_key=extra_info", "+data.prompt_dict_keys=['question']",
    "+data.response_dict_keys=['answer']", "data.micro_batch_size_per_gpu=2", "data.train_batch_size=8",
    "data.max_length=64", "model.partial_pretrain={base}/sft/tiny", "optim.lr=1e-3",
    "trainer.total_training_steps=2", "trainer.default_local_dir={base}/sft/verl", "trainer.logger=console",
    "trainer.project_name=p", "trainer.experiment_name=e", "ulysses_sequence_parallel_size=1",
    "use_remove_padding=true", "trainer.n_gpus_per_node=2"], sft=True)


@pytest.fixture(scope="module")
def runs(shared):
    out = {name: shared.path(f"sft/{name}") for name in ("full", "stopped", "resumed", "one")}
    for name in out:
        shared.ran(f"sft/{name}")
    procs = {"stopped_steps": [row["step"] for row in read_metrics(out["stopped"])],
             "resumed_stdout": shared.stdout("sft/resumed")}
    return {**out, "procs": procs}


def test_two_ranks_learn_validate_plot_and_export(runs):
    from transformers import AutoModelForCausalLM

    rows = read_metrics(runs["full"])
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["train/loss"] < rows[0]["train/loss"] - 0.5
    assert "val/loss" in rows[-1] and all("val/loss" not in r for r in rows[:-1])
    assert rows[-1]["train/lr"] > 0 and rows[0]["train/grad_norm"] > 0 and rows[0]["perf/tokens_per_s"] > 0
    assert sorted(p.name for p in (runs["full"] / "plots").iterdir()) == ["loss.png", "throughput.png"]
    hf = runs["full"] / "hf"
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    assert (hf / "tokenizer.json").exists() and (hf / "generation_config.json").exists()
    trained = params(runs["full"])
    for name, p in model.named_parameters():
        assert torch.equal(p, trained[name]), name


def test_resume_continues_exactly(runs):
    assert runs["procs"]["stopped_steps"] == [1, 2]
    assert "resumed from" in runs["procs"]["resumed_stdout"]
    assert steady(runs["resumed"]) == steady(runs["full"])
    a, b = params(runs["full"]), params(runs["resumed"])
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_one_and_two_ranks_agree_on_the_loss(runs):
    one, two = read_metrics(runs["one"]), read_metrics(runs["full"])
    assert len(one) == len(two) == 4
    # float32; the ranks' gradient sums add in another order, which the norm (a sum of 4.5M squares) shows
    # more than the loss.
    for a, b in zip(one, two):
        for key, tol in (("train/loss", 2e-5), ("train/grad_norm", 3e-4), ("train/tokens", 0)):
            assert math.isclose(a[key], b[key], rel_tol=tol), (a["step"], key, a[key], b[key])
    assert math.isclose(one[-1]["val/loss"], two[-1]["val/loss"], rel_tol=2e-5)


def test_bad_sft_data_stops_before_work_with_one_sentence(tmp_path, spmdrl_cache):
    from spmdrl.builtin.tasks import write_parquet

    path = write_parquet([{"prompt": "What is 1 + 1?", "answer": "2"}], tmp_path / "bad.parquet")
    proc = sft(tmp_path / "out", spmdrl_cache, "--data.train_files", str(path), nproc=1, check=False)
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert "bad.parquet" in line and "no column 'response'" in line and "row 0" in line
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_verl_sft_command_line_runs_with_only_the_module_renamed(shared):
    rows = shared.rows("sft/verl")
    assert [r["step"] for r in rows] == [1, 2] and "val/loss" in rows[-1]
    assert shared.path("sft/verl/hf/model.safetensors").exists()
def test_megatron_takes_the_fsdp2_steps(shared):
    pytest.importorskip("megatron.core")
    fsdp2, megatron = shared.rows("sft/fsdp2"), shared.rows("sft/megatron")
    # The same initial weights and rows: the loss agrees to float32 rounding (1e-5) at step 1 and after one
    # AdamW step (1e-4); the gradient norm, summed in another order over other shards, to 3e-4.
    for step, tol in ((0, 1e-5), (1, 1e-4)):
        assert math.isclose(megatron[step]["train/loss"], fsdp2[step]["train/loss"], rel_tol=tol), step
        assert math.isclose(megatron[step]["train/grad_norm"], fsdp2[step]["train/grad_norm"], rel_tol=3e-4)


def test_fresh_start_keeps_an_earlier_run_and_a_held_folder_is_refused(tmp_path, spmdrl_cache):
    from spmdrl.checkpoint.run_folder import OutputLock

    out = tmp_path / "out"
    (out / "hf").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1, "train/loss": 9.0}\n')
    (out / "hf" / "model.safetensors").write_text("the earlier export")
    lock = OutputLock.acquire(out)
    try:
        held = sft(out, spmdrl_cache, nproc=1, check=False)
    finally:
        lock.release()
    assert held.returncode == 2 and "is in use" in held.stderr.strip().splitlines()[-1]
    sft(out, spmdrl_cache, "--trainer.total_steps", "1", "--trainer.save_freq", "-1", "--data.val_files",
        "null", nproc=1)
    (earlier,) = (out / "previous").iterdir()
    assert (earlier / "metrics.jsonl").read_text() == '{"step": 1, "train/loss": 9.0}\n'
    assert (earlier / "hf" / "model.safetensors").read_text() == "the earlier export"
    assert [r["step"] for r in read_metrics(out)] == [1] and (out / "hf" / "model.safetensors").exists()


def test_lora_sft_trains_adapters_and_exports_merged_weights(shared, spmdrl_cache, monkeypatch):
    import json

    from safetensors.torch import load_file

    from spmdrl.builtin.models import resolve_builtin_model

    out = shared.path("sft/lora")
    shared.ran("sft/lora")
    shapes = json.loads((out / "checkpoints" / "global_step_2" / "manifest.json").read_text())["model_shapes"]
    assert all(".lora_A." in n or ".lora_B." in n for n in shapes["actor"])
    monkeypatch.setenv("SPMDRL_CACHE", spmdrl_cache)
    base = load_file(str(resolve_builtin_model("builtin:tiny")) + "/model.safetensors")
    merged = load_file(str(out / "hf" / "model.safetensors"))
    assert sorted(merged) == sorted(base)  # merged: the base model's names, no adapter tensors
    moved = {k for k in base if not torch.equal(base[k], merged[k])}
    assert moved and all(k.endswith("proj.weight") for k in moved)  # only adapted linear layers changed
