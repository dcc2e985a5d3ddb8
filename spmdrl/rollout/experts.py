"""Mixture-of-Experts weights and routes between the trainer's layout and a rollout engine's.

transformers 5 keeps a Qwen3-MoE layer's experts as two fused tensors, ``mlp.experts.gate_up_proj``
[E, 2I, h] (rows gate | up) and ``mlp.experts.down_proj`` [E, h, I]; its checkpoints, and the loaders of
vLLM, SGLang and the native engine, take one tensor an expert (``mlp.experts.{e}.gate_proj.weight`` ...).
``per_expert`` turns the first into the second as views, without copies.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

_GATE_UP, _DOWN = ".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"


def per_expert(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs with every fused expert tensor split into its experts' HF checkpoint names."""
    for name, t in named:
        if name.endswith(_GATE_UP):  # [E, 2I, h]
            prefix, inner = name[: -len(_GATE_UP)], t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{prefix}.mlp.experts.{e}.gate_proj.weight", t[e, :inner]
                yield f"{prefix}.mlp.experts.{e}.up_proj.weight", t[e, inner:]
        elif name.endswith(_DOWN):  # [E, h, I]
            prefix = name[: -len(_DOWN)]
            for e in range(t.shape[0]):
                yield f"{prefix}.mlp.experts.{e}.down_proj.weight", t[e]
        else:
            yield name, t
