"""Training rows with chosen prompt and response lengths, laid out as ``batch.from_generation`` makes them
(prompts left-padded, responses right-padded), the two losses the engine tests train with, and the FSDP2
engine they train (a world of one, or the meshes of a multi-process test's ``ParallelDims``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from spmdrl.batch import Batch

if TYPE_CHECKING:
    from spmdrl.engines.fsdp2.engine import FSDP2Engine
    from spmdrl.parallel import ParallelDims


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


def fsdp2_engine(model_dir: Path | str, role: str = "actor", *, dims: ParallelDims | None = None,
                 **kw) -> FSDP2Engine:
    """An FSDP2 engine of ``role`` on the FSDP and TP meshes of ``dims`` (built), on ``kw["dp_mesh"]``, or
    else on a world of one; CPU, lr 1e-4, seed 0 unless ``kw`` says otherwise."""
    from spmdrl.engines.fsdp2.engine import FSDP2Engine
    from spmdrl.parallel import ParallelDims

    if dims is None and "dp_mesh" not in kw:
        dims = ParallelDims(1).build()
    meshes = {} if dims is None else {"dp_mesh": dims.dp_mesh, "tp_mesh": dims.tp_mesh,
                                      "sp_mesh": dims.sp_mesh, "fsdp_mesh": dims.fsdp_mesh,
                                      "expert_mesh": dims.expert_mesh}
    return FSDP2Engine(str(model_dir), role=role, **{"device": "cpu", "lr": 1e-4, "seed": 0, **meshes, **kw})
