"""The FSDP2 engine's eager attention (spmdrl/engines/fsdp2/attention.py) against transformers' eager
attention: the same outputs and gradients, with one saved copy of the scores instead of two."""

from __future__ import annotations

import pytest
import torch


class _Module(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups


def _inputs(dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 9, 8, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(2, 2, 9, 8, generator=g).to(dtype).requires_grad_() for _ in range(2))
    mask = torch.full((9, 9), torch.finfo(dtype).min, dtype=dtype).triu_(1)[None, None]
    return q, k, v, mask


def _run(fn, dtype: torch.dtype) -> tuple[list[torch.Tensor], int]:
    """Outputs and gradients of ``fn``, and the bytes autograd saved for its backward."""
    q, k, v, mask = _inputs(dtype)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size() if t.dim() == 4 and t.shape[-1] == 9 else 0)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = fn(_Module(2), q, k, v, mask, scaling=0.35)
    out.float().pow(2).sum().backward()
    return [out, q.grad, k.grad, v.grad], sum(saved)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_lean_eager_equals_transformers_eager(dtype, tol):
    from transformers.models.qwen2.modeling_qwen2 import eager_attention_forward

    from spmdrl.engines.fsdp2.attention import eager

    mine, mine_bytes = _run(eager, dtype)
    ref, ref_bytes = _run(eager_attention_forward, dtype)
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)
    # Scores saved for the backward: one copy in the compute dtype; transformers' bf16 keeps float32 ones.
    assert mine_bytes == 2 * 4 * 9 * 9 * torch.finfo(dtype).bits // 8
    if dtype == torch.bfloat16:
        assert ref_bytes == 2 * mine_bytes
