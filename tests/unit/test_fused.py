"""Fused (compiled) RMSNorm and SwiGLU against transformers' eager modules, on a small Qwen2 / Qwen3."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from spmdrl.engines.fsdp2.fused import apply_fused_kernels, compiler_available, resolve_fused_kernels

needs_compiler = pytest.mark.skipif(not compiler_available("cpu"), reason="no C++ compiler for inductor")


def _model(kind: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common)).to(dtype)
    return Qwen2ForCausalLM(Qwen2Config(**common)).to(dtype)


@needs_compiler
@pytest.mark.parametrize("kind,dtype,tol", [("qwen2", torch.float32, 1e-5), ("qwen3", torch.float32, 1e-5),
                                            ("qwen2", torch.bfloat16, 3e-2)])
def test_fused_matches_eager_forward_and_backward(kind: str, dtype: torch.dtype, tol: float):
    eager = _model(kind, dtype)
    fused = copy.deepcopy(eager)
    # Per layer: input/post-attention norms and the MLP, plus the final norm (+ q/k norms for Qwen3).
    per_layer = 5 if kind == "qwen3" else 3
    assert apply_fused_kernels(fused) == 2 * per_layer + 1
    assert list(fused.state_dict()) == list(eager.state_dict())  # names (what export/checkpoints use) kept
    ids = torch.randint(0, 97, (3, 11))
    for lengths in (11, 7):  # a second shape must reuse the dynamic graph, not fail
        x = ids[:, :lengths]
        out_e, out_f = eager(input_ids=x).logits, fused(input_ids=x).logits
        torch.testing.assert_close(out_f.float(), out_e.float(), atol=tol, rtol=tol)
        out_e.float().square().mean().backward()
        out_f.float().square().mean().backward()
        for (name, pe), pf in zip(eager.named_parameters(), fused.parameters()):
            scale = pe.grad.float().abs().max().clamp(min=1e-6)
            err = (pf.grad.float() - pe.grad.float()).abs().max() / scale
            assert err < tol, f"{name}: relative gradient error {err:.2e}"
        eager.zero_grad(), fused.zero_grad()


def test_resolve_fused_kernels_rule_and_errors():
    assert resolve_fused_kernels("off", "cpu", 1) is False
    assert resolve_fused_kernels("auto", "cuda", 1) is False  # not measured on GPU: opt in with "on"
    assert resolve_fused_kernels("auto", "cpu", 2) is False
    assert resolve_fused_kernels("auto", "cpu", 1) is compiler_available("cpu")
    with pytest.raises(ValueError, match="tensor parallelism"):
        resolve_fused_kernels("on", "cpu", 2)
    with pytest.raises(ValueError, match="'fast'"):
        resolve_fused_kernels("fast", "cpu", 1)  # type: ignore[arg-type]


def test_inductor_cache_is_kept_per_cpu_capability(tmp_path):
    """Inductor's FX graph cache does not key on the vector ISA: C++ written for AVX2
    (ATEN_CPU_CAPABILITY=avx2, the ISA-hidden tier) reloaded by an AVX-512 process corrupted its heap.
    Each capability gets its own folder under the user's TORCHINDUCTOR_CACHE_DIR (or
    $SPMDRL_CACHE/inductor), and applying it twice nests once."""
    import os
    import subprocess
    import sys

    code = ("import os; from spmdrl.engines.fsdp2 import fused; fused._isa_keyed_inductor_cache(); "
            "fused._isa_keyed_inductor_cache(); print(os.environ['TORCHINDUCTOR_CACHE_DIR'])")
    dirs = {}
    for cap in ("default", "avx2"):
        env = {**os.environ, "ATEN_CPU_CAPABILITY": cap, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        dirs[cap] = out.stdout.strip().splitlines()[-1]
    assert dirs == {"default": str(tmp_path / "isa-DEFAULT"), "avx2": str(tmp_path / "isa-AVX2")}
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    out = subprocess.run([sys.executable, "-c", code], env={**env, "SPMDRL_CACHE": str(tmp_path)},
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1].startswith(str(tmp_path / "inductor" / "isa-"))
