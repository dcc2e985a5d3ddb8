"""The offline tiny-model kit: a real Hugging Face folder, deterministic per seed, loadable offline."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_folder_loads_offline_with_transformers(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    names = {p.name for p in tiny_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "qwen2"
    assert 4e6 < sum(p.numel() for p in model.parameters()) < 6e6
    text = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(tok("12")["input_ids"]) == ["1", "2"]  # digits are single tokens
    assert GenerationConfig.from_pretrained(tiny_model_dir).eos_token_id == [tok.eos_token_id]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tok)) and torch.isfinite(logits).all()


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    from spmdrl.builtin.models import build_model

    a, b, c = (build_model(tmp_path / n, "tiny", seed=s) for n, s in (("a", 3), ("b", 3), ("c", 4)))
    for f in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert json.loads((a / "spmdrl_builtin.json").read_text()) == {"size": "tiny", "seed": 3}


def test_cli_and_builtin_resolution(tmp_path, monkeypatch):
    from spmdrl.builtin.models import resolve_builtin_model

    out = subprocess.run([sys.executable, "-m", "spmdrl.builtin.models", "--out", str(tmp_path / "m"),
                          "--seed", "1"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0 and "size=tiny" in out.stdout
    monkeypatch.setenv("SPMDRL_CACHE", str(tmp_path / "cache"))
    path = resolve_builtin_model("builtin:tiny")
    assert Path(path, "config.json").is_file() and path.startswith(str(tmp_path / "cache"))
    assert resolve_builtin_model("/some/folder") == "/some/folder"
    with pytest.raises(ValueError, match="valid: builtin:tiny, builtin:small"):
        resolve_builtin_model("builtin:huge")


def test_warm_start_names_and_a_failed_build_leaves_nothing(tmp_path, monkeypatch):
    """``builtin:tiny-arith`` is a known name with the tiny model's size; a build whose SFT child fails raises
    one error with the child's message and leaves no folder in the cache (the next run builds again)."""
    from spmdrl.builtin import models

    assert models.check_builtin_model("builtin:tiny-arith") == ("tiny-arith", "tiny", False)
    monkeypatch.setenv("SPMDRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("RANK", "5")  # torchrun's variables must not reach the child: it would wait for 6
    monkeypatch.setenv("WORLD_SIZE", "6")
    bad = {**models.WARM_STARTS["tiny-arith"], "data.train_files": str(tmp_path / "missing.parquet")}
    monkeypatch.setitem(models.WARM_STARTS, "tiny-arith", bad)
    with pytest.raises(RuntimeError, match=r"building builtin:tiny-arith failed: spmdrl.sft exited 2(.|\n)*"
                                           r"missing.parquet"):
        models.resolve_builtin_model("builtin:tiny-arith")
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir() if "arith" in p.name] == []


@pytest.mark.parametrize("size, shapes, params", [
    ("qwen2.5-0.5b-shape", dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                                intermediate_size=4864, max_window_layers=24), 494_032_768),
    ("qwen2.5-1.5b-shape", dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                                intermediate_size=8960, max_window_layers=21), 1_543_714_304),
])
def test_qwen2_5_shapes_have_those_checkpoints_shapes(tmp_path, size, shapes, params):
    """``builtin:qwen2.5-0.5b-shape`` / ``-1.5b-shape`` are Qwen2.5-0.5B's / -1.5B-Instruct's config.json
    with the built-in tokenizer: the same parameter counts (on the meta device: the suite never writes their
    GBs of weights), and the memory plan's count from the same sizes agrees."""
    import torch
    from transformers import Qwen2ForCausalLM

    from spmdrl.builtin.models import build_tokenizer, check_builtin_model, model_config
    from spmdrl.config.shape import ModelShape

    assert check_builtin_model(f"builtin:{size}") == (size, size, False)
    tok = build_tokenizer(tmp_path, seed=0)
    cfg = model_config(size, tok).to_dict()
    want = dict(num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                max_position_embeddings=32768, rms_norm_eps=1e-6, eos_token_id=tok.eos_token_id, **shapes)
    assert {k: cfg[k] for k in want} == want
    assert cfg.get("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta")) == 1e6
    with torch.device("meta"):
        model = Qwen2ForCausalLM(model_config(size, tok))
    assert sum(p.numel() for p in model.parameters()) == params == ModelShape.of(f"builtin:{size}").params


def test_a_vocabulary_wider_than_the_tokenizer_is_padding(tmp_path, monkeypatch):
    """A size with a wider vocab_size (as the 0.5B shape has) writes an embedding of that many rows and its
    weight dtype; the model may sample a padding id, which the tokenizer decodes to no text."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spmdrl.builtin import models

    monkeypatch.setitem(models.SIZES, "tiny-wide", {**models.SIZES["tiny"], "vocab_size": 4096,
                                                    "torch_dtype": "bfloat16"})
    out = models.build_model(tmp_path / "wide", "tiny-wide", seed=0)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    assert embed.shape == (4096, 256) and embed.dtype == torch.bfloat16
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == 2048 and tok.decode([5, 3000, 4095]) == tok.decode([5])
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        assert model(torch.tensor([[5, 3000]])).logits.shape == (1, 2, 4096)


def test_tiny_moe_is_a_qwen3_moe_model_the_plan_counts(tmp_path):
    """``builtin:tiny-moe``: Qwen3-MoE (8 experts, 2 a token) on the built-in tokenizer; the plan counts its
    parameters exactly (every expert, the routers, Qwen3's q / k norms) and its MLP width as the 2 routed
    experts'. A model mixing dense and MoE layers is refused with one sentence."""
    import torch
    from transformers import AutoModelForCausalLM

    from spmdrl.builtin.models import build_tokenizer, builtin_config, model_config
    from spmdrl.config.shape import ModelShape

    cfg = model_config("tiny-moe", build_tokenizer(tmp_path, seed=0))
    assert cfg.model_type == "qwen3_moe" and (cfg.num_experts, cfg.num_experts_per_tok) == (8, 2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    shape = ModelShape.of("builtin:tiny-moe")
    assert sum(p.numel() for p in model.parameters()) == shape.params
    assert shape.intermediate == 2 * cfg.moe_intermediate_size
    with pytest.raises(ValueError, match="mixes dense and MoE layers"):
        ModelShape.from_config({**builtin_config("builtin:tiny-moe"), "decoder_sparse_step": 2})


def test_the_qwen3_30b_a3b_shape_is_planned_and_never_built(tmp_path):
    """``builtin:qwen3-30b-a3b-shape``: Qwen3-30B-A3B's config.json, whose 30.5B parameters the plan counts
    exactly (a meta-device model of its config); a run on it is refused unless it only plans, and it is
    never built."""
    import torch
    from transformers import AutoModelForCausalLM

    from spmdrl.builtin.models import build_model, build_tokenizer, model_config
    from spmdrl.config.shape import ModelShape

    cfg = model_config("qwen3-30b-a3b-shape", build_tokenizer(tmp_path, seed=0))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    shape = ModelShape.of("builtin:qwen3-30b-a3b-shape")
    assert sum(p.numel() for p in model.parameters()) == shape.params == 30_532_122_624
    assert (shape.experts, shape.intermediate) == (128, 8 * 768)
    with pytest.raises(ValueError, match="never built"):
        build_model(tmp_path / "big", "qwen3-30b-a3b-shape")
