"""The native engine's C++ decode kernels against its torch path (itself tested against transformers).

    pytest tests/unit/test_native_kernels.py

Skipped where the kernels cannot build (no g++ / ninja); everything else in the
engine then runs the torch path, which test_native_rollout.py covers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spmdrl.rollout.base import SamplingParams
from spmdrl.rollout.native import kernels as native_kernels
from spmdrl.rollout.native.engine import NativeRollout, left_pad
from spmdrl.rollout.native.model import Decoder

pytestmark = pytest.mark.skipif(not native_kernels.load_kernels(), reason="C++ kernels did not build here")
PAD = 0


def _random_model(tmp: Path, kind: str) -> Path:
    """Qwen3 (q/k-norm) or Llama (attention and MLP biases, untied head), head_dim 32, random norms."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, head_dim=32,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if kind == "qwen3":
        cfg, cls = Qwen3Config(tie_word_embeddings=True, rope_theta=1e6, **common), Qwen3ForCausalLM
    else:
        cfg = LlamaConfig(tie_word_embeddings=False, attention_bias=True, mlp_bias=True, **common)
        cls = LlamaForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        model = cls(cfg).float()
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 1:
                    p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp / kind)
    return tmp / kind


def _teacher_forced(model: Decoder, prompts: list[list[int]], forced: torch.Tensor) -> torch.Tensor:
    """Logits [steps, B, V] of decode steps fed ``forced`` [steps, B] after a left-padded prefill."""
    ids, valid = left_pad(prompts, PAD, torch.device("cpu"))
    B, T = ids.shape
    steps = forced.shape[0]
    kv = model.new_cache(B, T + steps).layout(B, T + steps)
    pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        model.prefill(ids, pos, valid, kv)
        kv.bias.fill_(float("-inf"))
        kv.bias[:, :T] = torch.where(valid, 0.0, float("-inf"))
        out = []
        for s in range(steps):
            kv.bias[:, T + s] = 0.0
            out.append(model.decode(forced[s], valid.sum(-1) + s, kv, T + s, B))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_decode_logits_match_torch_path(tmp_path, tiny_model_dir, kind, dtype):
    path = tiny_model_dir if kind == "qwen2" else _random_model(tmp_path, kind)
    eng = NativeRollout(str(path), dtype=dtype, kernels="on", pad_token_id=PAD)
    assert eng.model.kernels
    V = eng.config.vocab_size
    prompts = [[5, 9, 3], [7] * 11, [4, 8, 15, 16, 23, 42]]  # left padding of 8, 0 and 5 columns
    forced = torch.randint(3, V, (20, 3), generator=torch.Generator().manual_seed(0))
    fast = _teacher_forced(eng.model, prompts, forced)
    eng.model.kernels = False
    ref = _teacher_forced(eng.model, prompts, forced)
    if dtype == torch.float32:
        torch.testing.assert_close(fast, ref, atol=2e-5, rtol=0)
    else:  # bf16 rounds at other points (RoPE in fp32, probabilities unrounded): ~0.5-0.9% measured
        assert (fast - ref).norm() < 0.02 * ref.norm()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_transformers_arithmetic(dtype):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 5, 256, generator=g).to(dtype), torch.randn(256, generator=g).to(dtype)
    xf = x.float()
    ref = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    out = torch.ops.spmdrl_native.rms_norm(x, w, 1e-6)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
        return
    # The mean of squares is summed in another order than torch's (which itself differs between AVX2
    # and AVX-512), so a value on a bf16 rounding boundary may round the other way: allow one bf16
    # step of the normalised value (two of its product with w) on a few elements, the rest bit-equal.
    torch.testing.assert_close(out, ref, atol=0, rtol=2**-6)
    assert (out != ref).float().mean() < 0.01


def test_greedy_and_logprobs_same_with_and_without_kernels(tiny_model_dir):
    prompts = [[5, 9, 3], [7] * 11, [4, 8, 15, 16, 23, 42]]
    outs = []
    for mode in ("on", "off"):
        eng = NativeRollout(str(tiny_model_dir), kernels=mode, pad_token_id=PAD, eos_token_ids=[2])
        outs.append(eng.generate(prompts, SamplingParams(n=2, max_tokens=30, temperature=0.0)))
    assert torch.equal(outs[0].response_ids, outs[1].response_ids)
    torch.testing.assert_close(outs[0].logprobs, outs[1].logprobs, atol=1e-5, rtol=0)


def test_modes_and_errors(tiny_model_dir):
    with pytest.raises(ValueError, match="kernels='fast' is not valid"):
        NativeRollout(str(tiny_model_dir), kernels="fast")
    with pytest.raises(ValueError, match="float16"):
        native_kernels.resolve_kernels("on", torch.device("cpu"), torch.float16, 64)
    assert not native_kernels.resolve_kernels("auto", torch.device("cpu"), torch.float32, 48)
    assert not NativeRollout(str(tiny_model_dir), kernels="off").model.kernels
    assert NativeRollout(str(tiny_model_dir), kernels="auto").model.kernels


@pytest.mark.parametrize("V", [2048, 1000])
def test_sample_is_the_inverse_cdf_of_the_softmax(V):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(500, V, generator=g) * 3
    u = torch.rand(500, generator=g)
    tokens, lp = torch.ops.spmdrl_native.sample(logits, u, 0.7)
    probs = torch.softmax(logits.double() / 0.7, -1)
    ref = torch.searchsorted(probs.cumsum(-1), u.double()[:, None], right=True).squeeze(-1)
    assert torch.equal(tokens, ref)
    logp = torch.log_softmax(logits / 0.7, -1)
    torch.testing.assert_close(lp, logp.gather(-1, tokens[:, None]).squeeze(-1), atol=1e-5, rtol=0)
    # Greedy: the argmax and its temperature-1 log-prob.
    tokens, lp = torch.ops.spmdrl_native.sample(logits, torch.empty(0), 0.0)
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).amax(-1), atol=1e-5, rtol=0)


def test_sample_never_draws_a_masked_token():
    logits = torch.full((4, 300), float("-inf"))
    logits[:, 7] = 0.0
    logits[:, 290] = 1.0
    u = torch.tensor([0.0, 0.5, 1 - 1e-7, 0.999999])
    tokens, lp = torch.ops.spmdrl_native.sample(logits, u, 1.0)
    assert set(tokens.tolist()) <= {7, 290} and torch.isfinite(lp).all()
    assert tokens[0] == 7 and tokens[2] == 290
