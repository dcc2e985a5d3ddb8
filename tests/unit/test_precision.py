"""Hardware-aware precision and the fast-path checks: the decisions, and the plain paths they fall back to."""

from __future__ import annotations

import pytest
import torch

from spmdrl import precision
from spmdrl.precision import can_prepack, native_bf16, precision_summary, resolve_dtype, to_dtype
from spmdrl.rollout.base import SamplingParams
from spmdrl.rollout.native.engine import NativeRollout

CPU = torch.device("cpu")


def _onednn_says_bf16() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def test_dtype_names():
    assert to_dtype("bf16") is torch.bfloat16 and to_dtype("float32") is torch.float32
    with pytest.raises(ValueError, match="dtype 'fp8' is not valid; valid: float32, bfloat16, float16"):
        to_dtype("fp8")
    assert resolve_dtype("float16", "cpu") is torch.float16  # an explicit choice is kept


def test_auto_follows_onednn_unless_capped(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    native = _onednn_says_bf16()
    assert native_bf16("cpu")[0] is native
    assert resolve_dtype("auto", "cpu") is (torch.bfloat16 if native else torch.float32)
    # CI hides AVX-512 this way: the decision must flip on any machine.
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    ok, why = native_bf16("cpu")
    assert not ok and "ONEDNN_MAX_CPU_ISA=AVX2" in why
    assert resolve_dtype("auto", "cpu") is torch.float32
    assert not can_prepack(CPU, torch.bfloat16)


def test_summary_names_the_dtypes_and_the_reason(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    line, emulated = precision_summary("auto", "auto", "cpu")
    assert line.startswith("precision: compute float32, rollout float32 (auto: ") and not emulated
    line, emulated = precision_summary("bfloat16", "auto", "cpu")
    assert "compute bfloat16, rollout float32 (rollout auto: ONEDNN_MAX_CPU_ISA=AVX2" in line and emulated
    line, _ = precision_summary("float32", "float32", "cpu")
    assert "(as configured: " in line


def test_prepack_needs_onednn_and_native_bf16(monkeypatch):
    monkeypatch.setattr(precision, "native_bf16", lambda device_type: (False, "test: no native bf16"))
    assert not can_prepack(CPU, torch.bfloat16)
    assert not can_prepack(CPU, torch.float16) and not can_prepack(torch.device("meta"), torch.float32)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)  # e.g. an aarch64 build
    assert not can_prepack(CPU, torch.float32)


def _engine(path, **kw) -> NativeRollout:
    return NativeRollout(str(path), eos_token_ids=[2], pad_token_id=0, **kw)


def test_native_engine_without_onednn_runs_the_plain_path(tiny_model_dir, monkeypatch):
    """What an aarch64 build without oneDNN gets: no prepacking, the same tokens and log-probs."""
    prompts, greedy = [[5, 9, 13, 7], [11, 3]], SamplingParams(n=1, max_tokens=8, temperature=0.0)
    fast = _engine(tiny_model_dir)
    expected = fast.generate(prompts, greedy)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    plain = _engine(tiny_model_dir, kernels="off")
    assert not plain.prepack and not plain.model.kernels
    out = plain.generate(prompts, greedy)
    assert not plain.model.packed
    assert torch.equal(out.response_ids, expected.response_ids)
    torch.testing.assert_close(out.logprobs, expected.logprobs, atol=1e-4, rtol=0)


def test_bf16_without_native_support_runs_unpacked(tiny_model_dir, monkeypatch):
    """An explicit bf16 rollout on a CPU without native bf16: no oneDNN prepack (it would raise), still
    runs."""
    monkeypatch.setattr(precision, "native_bf16", lambda device_type: (False, "test: no native bf16"))
    eng = _engine(tiny_model_dir, dtype="bfloat16")
    assert not eng.prepack
    out = eng.generate([[5, 9, 13, 7]], SamplingParams(n=2, max_tokens=6))
    assert out.response_ids.shape == (2, 6) and torch.isfinite(out.logprobs).all()
    with pytest.raises(ValueError,
                       match="prepack=True needs a CPU with oneDNN and float32, or bfloat16 with"):
        _engine(tiny_model_dir, dtype="bfloat16", prepack=True)
