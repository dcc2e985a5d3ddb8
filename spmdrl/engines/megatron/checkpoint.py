"""A Megatron engine's checkpoint folder read back as Hugging Face tensors, in one plain process, without
megatron-core and without a process group.

The engine saves every parameter shard as ``tp{r}.{name}`` with the layer's global index
(``MegatronEngine._state_names``): the keys are the same on data-parallel replicas and distinct per TP
rank and pipeline stage, so the folder holds each shard once whatever the layout. The TP size comes
from the keys, the shapes from the manifest's ``model_shapes``; the shards of each rule (``convert.py``)
are joined by ``to_hf``, the conversion the live ``export_weights`` uses, one decoder layer at a time.

    for name, tensor in read_checkpoint(step_dir / "actor", step_dir / "model_files", manifest, "actor"): ...
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Iterator

import torch

from spmdrl.checkpoint.safe_load import load_model_tensors
from spmdrl.engines.megatron.convert import HFArch, Rule, global_rules, layer_rules, to_hf
from spmdrl.errors import ConfigError
from spmdrl.precision import DTYPES

_KEY = re.compile(r"^tp(\d+)\.(.+)$")

Step = list[tuple[str, Rule, tuple[str, ...]]]  # (Megatron name with global layer index, rule, HF names)


def _plan(arch: HFArch) -> list[Step]:
    """The exported tensors in HF order, grouped as they are loaded: the embedding, each decoder layer, then
    the final norm with the head (none when tied: it is the embedding)."""
    embed, norm, *heads = global_rules(arch)
    plan = [[(embed.mg, embed, embed.hf)]]
    for i in range(arch.num_layers):
        plan.append([(f"decoder.layers.{i}.{r.mg}", r, tuple(f"model.layers.{i}.{h}" for h in r.hf))
                     for r in layer_rules(arch)])
    last = [(norm.mg, norm, norm.hf)]
    if not arch.tie_word_embeddings:
        last += [(head.mg, head, head.hf) for head in heads]
    return plan + [last]


def _tp_size(saved: dict[str, list[int]], where: str) -> int:
    ranks = {int(m.group(1)) if (m := _KEY.match(key)) else -1 for key in saved}
    if -1 in ranks or ranks != set(range(len(ranks))):
        raise ConfigError(f"checkpoint {where!r} has weights that are not Megatron's tp{{rank}}.{{name}} "
                          f"keys of TP ranks 0..n-1; it was not written by the megatron engine")
    return len(ranks)


def read_checkpoint(folder: Path, model_files: Path, manifest: dict,
                    role: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` of ``role`` (actor, ref or critic) saved in ``folder``
    (``global_step_N/{role}``), in HF order; a tied ``lm_head.weight`` is left out, as
    ``MegatronEngine.export_weights`` does."""
    where = str(folder.parent)
    saved = manifest["model_shapes"][role]
    arch = HFArch.from_folder(model_files)
    if role == "critic":  # as the engine builds it: a value head in place of the (untied) LM head
        arch = dataclasses.replace(arch, value_head=True, tie_word_embeddings=False)
    tp = _tp_size(saved, where)
    plan = _plan(arch)
    needed = {f"tp{r}.{mg}" for step in plan for mg, _, _ in step for r in range(tp)}
    # A pipeline's last stage keeps its own copy of a tied embedding (output_layer.weight): not exported.
    tied_copy = {f"tp{r}.output_layer.weight" for r in range(tp)} if arch.tie_word_embeddings else set()
    odd = sorted((needed - set(saved)) | (set(saved) - needed - tied_copy))
    if odd:
        raise ConfigError(f"checkpoint {where!r} does not match its config.json ({role} weights {odd[:3]})")
    dtype = DTYPES[manifest["dtype"]]
    for step in plan:
        shards = load_model_tensors(folder, {f"tp{r}.{mg}": saved[f"tp{r}.{mg}"] for mg, _, _ in step
                                             for r in range(tp)}, dtype)
        for mg, rule, hf_names in step:
            full = to_hf(rule, [shards.pop(f"tp{r}.{mg}") for r in range(tp)], arch)
            yield from ((name, t.contiguous()) for name, t in zip(hf_names, full))
