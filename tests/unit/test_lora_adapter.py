"""model.lora_adapter_path: a PEFT adapter folder (what peft's save_pretrained writes) starts the FSDP2
actor's adapters, with the folder's r, alpha and targets; the actor then computes what peft's own merge of
that adapter computes. Folders without safetensors (a pickled adapter_model.bin) are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rows import fsdp2_engine

from spmdrl.errors import ConfigError

pytestmark = pytest.mark.usefixtures("gloo_world_of_one")


@pytest.fixture(scope="module")
def adapter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A PEFT folder of random (nonzero) adapters on q_proj and v_proj, and peft's merged weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=12, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # B starts at zero: make the adapter change something
    folder = tmp_path_factory.mktemp("adapter") / "peft"
    model.save_pretrained(str(folder))  # adapter_config.json + adapter_model.safetensors
    return folder, dict(model.merge_and_unload().state_dict())


def _engine(model_dir: Path, spec):
    return fsdp2_engine(model_dir, lora=spec)


def test_an_adapter_folder_starts_the_adapters_with_its_own_config(tiny_model_dir, adapter):
    from spmdrl.engines.fsdp2.lora import LoraSpec

    folder, merged = adapter
    # r and alpha given here lose to the folder's own
    eng = _engine(tiny_model_dir, LoraSpec(rank=16, alpha=16, adapter_path=str(folder)))
    ours = dict(eng.export_weights())
    assert max(float((merged[k] - v).abs().max()) for k, v in ours.items()) < 1e-6
    adapted = {n.split(".lora_")[0] for n, _ in eng.model.named_parameters() if ".lora_A." in n}
    assert adapted and all(n.endswith(("q_proj", "v_proj")) for n in adapted)


def test_a_folder_without_safetensors_is_refused_in_one_sentence(tmp_path):
    from spmdrl.engines.fsdp2.lora import read_adapter_config

    (tmp_path / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}')
    (tmp_path / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(ConfigError, match="adapter_model.safetensors"):
        read_adapter_config(str(tmp_path))
