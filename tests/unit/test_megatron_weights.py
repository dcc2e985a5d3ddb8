"""HF <-> Megatron conversion rules: every rule's two directions are inverse at tp=1, 2 and 4 (pure CPU)."""

import json

import pytest
import torch

from spmdrl.engines.megatron.convert import HFArch, global_rules, layer_rules, to_hf, to_megatron

CONFIG = dict(model_type="qwen3", vocab_size=30, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
              num_attention_heads=8, num_key_value_heads=4, head_dim=4, rms_norm_eps=1e-6,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)


def _arch(tmp_path, **over) -> HFArch:
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, **over}))
    return HFArch.from_folder(tmp_path)


def _hf_tensor(name: str, arch: HFArch) -> torch.Tensor:
    h, d = arch.hidden_size, arch.head_dim
    rows = {"q_proj": arch.num_heads * d, "k_proj": arch.num_kv_heads * d, "v_proj": arch.num_kv_heads * d,
            "o_proj": h, "gate_proj": arch.ffn_hidden_size, "up_proj": arch.ffn_hidden_size, "down_proj": h,
            "embed_tokens": arch.vocab_size, "lm_head": arch.vocab_size}
    module = name.split(".")[-2]
    if name.endswith("norm.weight") or module.endswith("norm") or module.endswith("layernorm"):
        shape = (d,) if module in ("q_norm", "k_norm") else (h,)
    elif name.endswith(".bias"):
        shape = (rows[module],)
    else:
        cols = {"o_proj": arch.num_heads * d, "down_proj": arch.ffn_hidden_size}.get(module, h)
        shape = (rows[module], cols)
    return torch.randn(shape, generator=torch.Generator().manual_seed(sum(name.encode())))


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "llama"])
def test_rules_round_trip(tmp_path, tp, model_type):
    arch = _arch(tmp_path, model_type=model_type)
    arch.check_parallel(tp, 1)
    rules = layer_rules(arch) + global_rules(arch)
    assert {"qkv", "gate_up", "row", "vocab", "replicated"} <= {r.kind for r in rules}
    for rule in rules:
        hf = [_hf_tensor(h, arch) for h in rule.hf]
        shards = [to_megatron(rule, hf, arch, r, tp) for r in range(tp)]
        assert len({s.shape for s in shards}) == 1  # equal shards, as Megatron's layers expect
        back = to_hf(rule, shards, arch)
        assert len(back) == len(hf) and all(torch.equal(a, b) for a, b in zip(back, hf)), rule.mg


def test_qkv_layout_is_grouped(tmp_path):
    """Megatron's fused qkv rows: per query group, its q heads, then its k head, then its v head."""
    arch = _arch(tmp_path)
    rule = next(r for r in layer_rules(arch) if r.mg == "self_attention.linear_qkv.weight")
    d, heads, groups = arch.head_dim, arch.num_heads, arch.num_kv_heads
    q = torch.arange(heads)[:, None].expand(heads, d).reshape(-1, 1).float()  # row value = q head index
    k = 100 + torch.arange(groups)[:, None].expand(groups, d).reshape(-1, 1).float()
    v = 200 + torch.arange(groups)[:, None].expand(groups, d).reshape(-1, 1).float()
    fused = to_megatron(rule, [q, k, v], arch, 0, 1)[::d, 0].tolist()  # one value per head
    assert fused[:4] == [0, 1, 100, 200] and fused[4:8] == [2, 3, 101, 201]


def test_unsupported_config_is_one_sentence(tmp_path):
    with pytest.raises(ValueError, match="model_type 'gpt2' has no Megatron conversion"):
        _arch(tmp_path, model_type="gpt2")
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        _arch(tmp_path, rope_parameters={"rope_type": "yarn", "rope_theta": 1.0})
    with pytest.raises(ValueError, match="o_proj / MLP biases would be lost"):
        _arch(tmp_path, model_type="llama", attention_bias=True)
    with pytest.raises(ValueError, match="parallel.tp=3 does not divide"):
        _arch(tmp_path).check_parallel(3, 1)
