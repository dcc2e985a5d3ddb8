"""LoRA on the FSDP2 engine (peft adapters): what is trained, what the reference and the rollout engine
see, what a checkpoint holds, and 2 ranks agreeing with 1.

One spawn per world size; each rank returns small values only (spawn's pipe would block on weight sets).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from dist_utils import spawn
from rows import fsdp2_engine, pg_loss, rows_with_lengths

pytestmark = pytest.mark.dist

SPEC = dict(rank=8, alpha=16.0)
LR = 1e-3


def _batch(vocab: int):
    return rows_with_lengths([5, 3, 4, 2], [4, 6, 2, 5], vocab, seed=3)


def _max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b) * mask).abs().max())


def _peft_merged(model_dir: str, adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """peft's own merge (get_peft_model + merge_and_unload) of our adapter tensors onto the base."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=SPEC["rank"], lora_alpha=SPEC["alpha"],
                                            target_modules="all-linear", lora_dropout=0.0))
    state = {f"base_model.model.{k}": v for k, v in adapters.items()}
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys and not [k for k in result.missing_keys if "lora_" in k]
    return dict(model.merge_and_unload().state_dict())


def _run(rank: int, world: int, model_dir: str, tmp: str) -> dict:
    from spmdrl.checkpoint.hf_folder import write_hf_folder
    from spmdrl.engines.fsdp2.lora import LoraSpec, is_adapter
    from spmdrl.parallel import ParallelDims

    dims = ParallelDims(world).build()
    full = _batch(2048)
    n = len(full) // world
    mine, mask = full.select(slice(rank * n, (rank + 1) * n)), full["response_mask"][rank * n:(rank + 1) * n]
    kw = dict(dims=dims, lr=LR)
    eng = fsdp2_engine(model_dir, lora=LoraSpec(**SPEC), **kw)
    base = fsdp2_engine(model_dir, **kw)
    out: dict = {}
    before = dict(eng.export_weights())
    out["starts_as_base"] = max(float((before[k] - w).abs().max()) for k, w in base.export_weights())
    eng.train_step(mine, pg_loss, mini_batch_size=n, micro_batch_size=1)
    raw = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in eng.model.state_dict().items()}
    frozen = {k: w for k, w in base.export_weights()}  # every base weight, under the adapted names

    def adapted(name: str) -> str:
        module, leaf = name.rsplit(".", 1)
        return f"{module}.base_layer.{leaf}" if f"{module}.base_layer.{leaf}" in raw else name

    out["base_unchanged"] = max(float((raw[adapted(k)] - w).abs().max()) for k, w in frozen.items())
    merged = dict(eng.export_weights())
    out["moved"] = max(float((merged[k] - before[k]).abs().max()) for k in merged)
    opt_params = [p for g in eng.optimizer.param_groups for p in g["params"]]
    trainable = {k for k, p in eng.model.named_parameters() if p.requires_grad}
    out["only_adapters_train"] = all(is_adapter(k) for k in trainable) and len(opt_params) == len(trainable)
    out["ckpt_keys_adapters"] = all(is_adapter(k) for k in eng.state_dict()["model"])
    # The reference is the base model: the adapters off, whatever they learned.
    out["ref_vs_base"] = _max_diff(eng.base_reference().forward_no_grad(mine, 2)["logp"],
                                   base.forward_no_grad(mine, 2)["logp"], mask)
    # What the rollout engine receives (merged weights) computes what the adapted actor computes.
    lora_logp = eng.forward_no_grad(mine, 2)["logp"]
    folder = Path(tmp) / "merged"
    if rank == 0:
        files = Path(tmp) / "files"  # the model's folder without its weights
        files.mkdir()
        for f in Path(model_dir).iterdir():
            if not f.name.endswith(".safetensors"):
                shutil.copyfile(f, files / f.name)
        write_hf_folder(iter(merged.items()), folder, files)
        adapters = {k: v.detach().clone() for k, v in raw.items() if is_adapter(k)}
        peft = _peft_merged(model_dir, adapters)
        out["vs_peft_merge"] = max(float((peft[k] - v).abs().max()) for k, v in merged.items())
    torch.distributed.barrier()
    plain = fsdp2_engine(folder, **kw)
    out["merged_vs_lora"] = _max_diff(plain.forward_no_grad(mine, 2)["logp"], lora_logp, mask)
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in merged.items()}, str(Path(tmp) / "merged.safetensors"))
    out["tmp"] = tmp
    critic = fsdp2_engine(model_dir, "critic", lora=LoraSpec(**SPEC), **kw)
    names = {k for k, p in critic.model.named_parameters() if p.requires_grad}
    out["critic_trains"] = sorted({"score" if k.startswith("score.") else "lora" if is_adapter(k) else k
                                   for k in names})
    return out


@pytest.fixture(scope="module")
def ranks(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return {w: spawn(_run, w, str(tiny_model_dir), str(tmp_path_factory.mktemp(f"lora{w}"))) for w in (1, 2)}


def test_adapters_train_alone_and_start_as_the_base(ranks):
    one = ranks[1][0]
    assert one["starts_as_base"] == 0.0 and one["base_unchanged"] == 0.0 and one["moved"] > 1e-4
    assert one["only_adapters_train"] and one["ckpt_keys_adapters"]
    assert ranks[1][0]["critic_trains"] == ["lora", "score"]


def test_reference_is_the_base_model_with_adapters_off(ranks):
    for r in ranks[1] + ranks[2]:
        assert r["ref_vs_base"] < 1e-6


def test_merged_weights_compute_what_the_adapted_actor_computes(ranks):
    for r in ranks[1] + ranks[2]:
        assert r["merged_vs_lora"] < 1e-5
    assert ranks[1][0]["vs_peft_merge"] < 1e-6  # the same merge peft's merge_and_unload does


def test_two_ranks_take_the_one_rank_step(ranks):
    from safetensors.torch import load_file

    one, two = (load_file(f"{ranks[w][0]['tmp']}/merged.safetensors") for w in (1, 2))
    assert max(float((one[k] - two[k]).abs().max()) for k in one) < 1e-5
