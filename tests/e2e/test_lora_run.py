"""GRPO with a LoRA actor under torchrun (2 CPU ranks, the tiny model): the rollout engine runs the merged
weights (its log-probs match the actor's), the reference is the base (the KL loss starts at 0 and moves),
the checkpoint holds only adapters and resumes, and it exports as a PEFT adapter folder that peft merges
onto the base into exactly the run's merged Hugging Face export. Both runs are in the shared 2-rank job
(tests/e2e/shared_runs.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import TINY, read_metrics
from shared_runs import declare

pytestmark = pytest.mark.e2e

LORA = ["--config", "configs/grpo.yaml", *TINY, "--model.path", "builtin:tiny", "--model.lora_rank", "8",
        "--model.lora_alpha", "16", "--actor.lr", "1e-3", "--actor.param_dtype", "float32",
        "--rollout.dtype", "float32", "--model.fused_kernels", "off", "--trainer.save_freq", "2",
        "--trainer.export_hf_on_save", "true",
        "--actor.ppo_epochs", "1"]  # one update a step: step 1's KL loss is the base's own (0)


declare("lora/run", [*LORA, "--trainer.total_steps", "2", "--trainer.output_dir", "{base}/lora/run"])
declare("lora/resumed", [*LORA, "--trainer.total_steps", "3", "--trainer.output_dir", "{base}/lora/run",
                         "--trainer.resume", "auto"])


@pytest.fixture(scope="module")
def run(shared):
    shared.ran("lora/run")
    return shared.path("lora/run"), shared.stdout("lora/resumed") + shared.stderr("lora/resumed")


def test_rollout_runs_the_merged_weights_and_the_reference_is_the_base(run):
    out, _ = run
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # Step 1: the adapters start at B = 0, so actor and reference agree; later steps move away from it.
    assert rows[0]["actor/kl_loss"] < 1e-6 < rows[-1]["actor/kl_loss"]
    for r in rows:  # float32 on both sides: the rollout engine holds the merged adapted weights
        assert r["rollout_corr/log_ppl_abs_diff"] < 1e-4, r


def test_checkpoint_holds_adapters_resumes_and_exports_a_peft_folder(run, tmp_path, spmdrl_cache,
                                                                     monkeypatch):
    out, resumed = run
    assert "resumed from" in resumed
    step = out / "checkpoints" / "global_step_2"
    shapes = json.loads((step / "manifest.json").read_text())["model_shapes"]["actor"]
    assert shapes and all(".lora_A." in n or ".lora_B." in n for n in shapes)
    adapter = tmp_path / "adapter"
    subprocess.run([sys.executable, "-m", "spmdrl.export", "--checkpoint", str(step), "--out", str(adapter)],
                   check=True, capture_output=True)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (8, 16)

    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from spmdrl.builtin.models import resolve_builtin_model

    monkeypatch.setenv("SPMDRL_CACHE", spmdrl_cache)
    base = AutoModelForCausalLM.from_pretrained(resolve_builtin_model("builtin:tiny"), dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload().state_dict()
    hf = load_file(str(step / "hf" / "model.safetensors"))
    assert max(float((merged[k] - v).abs().max()) for k, v in hf.items()) < 1e-6
    # The adapter names a base peft can load by itself: the run's builtin:tiny as the folder it resolved to.
    assert config["base_model_name_or_path"] == resolve_builtin_model("builtin:tiny")
    from peft import AutoPeftModelForCausalLM

    alone = AutoPeftModelForCausalLM.from_pretrained(str(adapter), dtype=torch.float32)
    again = alone.merge_and_unload().state_dict()
    assert max(float((again[k] - v).abs().max()) for k, v in hf.items()) < 1e-6
