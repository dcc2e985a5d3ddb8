"""FSDP2 gradient clipping and weight export on plain modules (no process group)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from spmdrl.engines.fsdp2.weights import clip_grad_norm_, iter_full_state


def test_clip_grad_norm_reports_pre_clip_norm_and_clips():
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    assert clip_grad_norm_([a, b], max_norm=1.0) == pytest.approx(5.0)
    assert torch.cat([a.grad, b.grad]).norm().item() == pytest.approx(1.0, rel=1e-5)
    assert clip_grad_norm_([a, b], max_norm=0.0) == pytest.approx(1.0, rel=1e-5)  # 0: report only


def test_iter_full_state_skips_tied_duplicates_and_checkpoint_prefix():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(5, 2)
            self.block = checkpoint_wrapper(nn.Linear(2, 2))
            self.head = nn.Linear(2, 5, bias=False)
            self.head.weight = self.embed.weight
            self.register_buffer("scale", torch.ones(1))
            self.register_buffer("cache", torch.ones(1), persistent=False)

    names = [n for n, _ in iter_full_state(Tied(), torch.bfloat16)]
    assert names == ["embed.weight", "block.weight", "block.bias", "scale"]
    assert all(t.dtype == torch.bfloat16 for _, t in iter_full_state(Tied(), torch.bfloat16))
