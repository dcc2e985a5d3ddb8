"""Training rows with chosen prompt and response lengths, laid out as ``batch.from_generation`` makes them
(prompts left-padded, responses right-padded), the two losses the engine tests train with, and the FSDP2
engine of a world of one they train."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from spmdrl.batch import Batch


def rows_with_lengths(prompt: Sequence[int], resp: Sequence[int], vocab: int, seed: int) -> Batch:
    """One row per (prompt, response) length pair: random token ids, advantages and returns."""
    g = torch.Generator().manual_seed(seed)
    prompt, resp = torch.as_tensor(prompt), torch.as_tensor(resp)
    n, p_max, r_max = len(prompt), int(prompt.max()), int(resp.max())
    pos = torch.arange(p_max + r_max)
    attn = ((pos >= p_max - prompt[:, None]) & (pos < p_max + resp[:, None])).long()  # [n, P+R]
    return Batch(dict(
        input_ids=torch.randint(3, vocab, (n, p_max + r_max), generator=g) * attn,
        attention_mask=attn,
        position_ids=(attn.cumsum(1) - 1).clamp(min=0),
        response_mask=attn[:, p_max:].float(),  # [n, R]
        advantages=torch.randn(n, r_max, generator=g),
        returns=torch.randn(n, r_max, generator=g),
    ))


def pg_loss(outputs, mb, scale):
    loss = -(outputs["logp"] * mb["advantages"] * mb["response_mask"]).sum() / scale.global_tokens
    return loss, {"actor/pg_loss": loss.item()}


def vf_loss(outputs, mb, scale):
    loss = 0.5 * ((outputs["values"] - mb["returns"]) ** 2 * mb["response_mask"]).sum() / scale.global_tokens
    return loss, {"critic/vf_loss": loss.item()}


def fsdp2_engine(model_dir: Path, role: str = "actor", **kw):
    """An FSDP2 engine of ``role`` on a world of one (lr 1e-4, seed 0 unless ``kw`` says otherwise)."""
    from spmdrl.engines.fsdp2.engine import FSDP2Engine
    from spmdrl.parallel import ParallelDims

    return FSDP2Engine(str(model_dir), role=role, dp_mesh=ParallelDims(1).build().fsdp_mesh, device="cpu",
                       **{"lr": 1e-4, "seed": 0, **kw})
