"""Parallelism for a Hugging Face decoder, applied by plain functions in a fixed order.

    model = AutoModelForCausalLM.from_pretrained(path)
    apply_tp(model, tp_mesh)                     # 1. DTensor tensor parallelism (Qwen2/Llama plan)
    apply_activation_checkpointing(model)        # 2. recompute each decoder layer in backward
    apply_compile(model)                         # 3. torch.compile each decoder layer (optional)
    apply_fsdp(model, dp_mesh, mp, offload)      # 4. fully_shard each decoder layer, then the root

The order matters: FSDP must see the final module tree (checkpoint wrappers
and compiled layers) and the TP DTensors, so it composes 2-D (dp x tp) shards
on top of them. The same functions serve the causal LM (actor, reference) and
the value model (critic), which differ only in where the decoder layers live.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

# Prefix torch's checkpoint wrapper puts into parameter names; export strips it to keep HF names.
CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."


def decoder_of(model: nn.Module) -> nn.Module:
    """The module holding ``embed_tokens``, ``layers`` and ``norm`` (``model.model`` for a causal LM)."""
    inner = getattr(model, "model", None)
    if isinstance(inner, nn.Module) and hasattr(inner, "layers"):
        return inner
    if hasattr(model, "layers"):
        return model
    raise ValueError(f"{type(model).__name__} has no decoder layers at .model.layers or .layers")


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Megatron-style TP for Qwen2/Llama layers without sequence parallelism.

    Attention and MLP are column-parallel in, row-parallel out, so each rank
    keeps ``heads / tp`` heads (the HF attention views with ``-1`` heads, so
    local head counts just work). Activations between blocks stay replicated,
    which keeps RMSNorm, rotary embeddings and the residual stream untouched.
    Embeddings are split over the vocabulary, and so are the LM head's rows: the
    fused head (``lm_head.FusedLMHead``) computes log-probs and entropy from its
    local rows with all-reduces over the TP group (vocab-parallel), so no rank
    ever holds full [tokens x vocabulary] logits.
    """
    tp = tp_mesh.size()
    cfg = model.config
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = getattr(cfg, name)
        if value % tp:
            raise ValueError(f"model config {name}={value} is not divisible by the training TP degree {tp}")
    decoder = decoder_of(model)
    for layer in decoder.layers:
        parallelize_module(
            layer,
            tp_mesh,
            {
                "self_attn.q_proj": ColwiseParallel(),
                "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(),
                "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(),
            },
        )
    parallelize_module(decoder, tp_mesh, {"embed_tokens": RowwiseParallel(input_layouts=Replicate())})
    lm_head = getattr(model, "lm_head", None)
    if lm_head is not None:
        if getattr(cfg, "tie_word_embeddings", False):
            # The embedding plan made a new [V, H] DTensor sharded on dim 0: the head's rows, re-tied.
            lm_head.weight = decoder.embed_tokens.weight
        else:  # rows over the TP ranks, and no input / output hooks: the fused head reads its local rows
            lm_head.weight = nn.Parameter(distribute_tensor(lm_head.weight, tp_mesh, [Shard(0)]),
                                          requires_grad=lm_head.weight.requires_grad)


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Wrap every decoder layer so its activations are recomputed in backward (non-reentrant)."""
    layers = decoder_of(model).layers
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)


def apply_compile(model: nn.Module) -> None:
    """Compile each decoder layer in place (``Module.compile`` keeps names and state-dict keys)."""
    for layer in decoder_of(model).layers:
        layer.compile(fullgraph=False)


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    cpu_offload: bool,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """``fully_shard`` each decoder layer, then the root (embeddings, final norm, heads).

    A 1-D ``dp_mesh`` shards over all its ranks (FSDP); a 2-D mesh
    ("dp_replicate", "dp_shard") replicates over dim 0 and shards over dim 1
    (HSDP). Each layer is its own all-gather / reduce-scatter unit, so at most
    one or two layers are unsharded at a time; the root keeps its parameters
    after forward (backward needs the LM head first). With expert parallelism (``expert_mesh``,
    expert_parallel.py) each layer's experts are a unit of their own over its ``efsdp`` axis, their
    gradients divided by the whole data-parallel size as every other parameter's.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # Pinned host memory speeds up H2D copies on CUDA; on a CPU (gloo) mesh only pin_memory=False works.
    pin = dp_mesh.device_type == "cuda"
    offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=pin) if cpu_offload else OffloadPolicy()
    for layer in decoder_of(model).layers:
        if expert_mesh is not None:
            experts = layer.mlp.experts
            fully_shard(experts, mesh=expert_mesh["efsdp"], mp_policy=mp, offload_policy=offload)
            experts.set_gradient_divide_factor(float(dp_mesh.size()))
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, offload_policy=offload)
