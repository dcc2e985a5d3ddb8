"""A megatron-core GPTModel from a Hugging Face config.json, and the HF <-> Megatron weight conversion.

    arch = HFArch.from_folder(path)                          # Llama / Qwen2 / Qwen3 decoder
    config = transformer_config(arch, tp=2, pp=1)
    model = build_gpt_model(arch, config, pre_process=True, post_process=True)
    load_hf_state(model, HFWeights(path), arch, tp_rank, tp)           # HF -> this rank's shards
    full = to_hf(rule, [shard of every TP rank], arch)                # this rank's shards -> HF

One table of ``Rule``s (``layer_rules`` / ``global_rules``) names every
Megatron parameter and the HF tensors it is made of; ``to_megatron`` and
``to_hf`` are the two directions of the same rule, so loading and exporting
cannot disagree. Megatron layouts, per TP rank (``tp`` ranks, ``r`` this one):

- ``linear_qkv`` [(nq + 2 ng) d / tp, H]: per query group, its q heads then its
  k and v head, groups contiguous (so a TP shard is a block of whole groups).
- ``linear_fc1`` [2 F / tp, H]: this rank's slice of gate_proj, then its slice of
  up_proj (Megatron's gated MLP splits its column-parallel output in two).
- column-parallel weights (qkv, fc1, vocab rows) split dim 0, row-parallel ones
  (``linear_proj``, ``linear_fc2``, kind ``row``) dim 1, norms are replicated.
- the vocabulary is padded to a multiple of ``tp`` (``VocabParallelEmbedding``
  needs equal shards); padded rows are zeros and never exported.
- a critic (``HFArch.value_head``) has no LM head: its last stage's
  ``output_layer`` is a replicated [1, H] linear with a bias, HF's
  ``*ForTokenClassification`` ``score.weight`` / ``score.bias``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Sequence

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")

Kind = Literal["replicated", "row", "vocab", "qkv", "gate_up"]


@dataclass(frozen=True)
class HFArch:
    """The decoder shape of a Llama-family HF config (what GPTModel needs)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    value_head: bool = False  # a critic: the output layer is score [1, H] + bias, never tied to the embedding

    @classmethod
    def from_folder(cls, path: str | Path) -> "HFArch":
        """Read ``path/config.json``; ValueError (one sentence) for what GPTModel here cannot express."""
        file = Path(path) / "config.json"
        return cls.from_dict(json.loads(file.read_text()), str(file))

    @classmethod
    def from_dict(cls, cfg: dict, file: str) -> "HFArch":
        """``from_folder`` on the parsed config.json (``file`` names it in errors)."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"{file}: model_type {model_type!r} has no Megatron conversion; supported: "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"{file}: rope type {rope_type!r} is not converted to Megatron; "
                             f"only 'default' RoPE")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{file}: hidden_act {cfg.get('hidden_act')!r} is not converted; "
                             f"only 'silu' (SwiGLU)")
        if model_type != "qwen2" and cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise ValueError(f"{file}: attention_bias / mlp_bias is true; Megatron's layers here have biases "
                             f"only on q, k and v (Qwen2), so the o_proj / MLP biases would be lost")
        if float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
            raise ValueError(f"{file}: partial_rotary_factor is not 1; only full-width RoPE is converted")
        if cfg.get("use_sliding_window"):
            raise ValueError(f"{file}: use_sliding_window is true; Megatron's GPTModel here is full "
                             f"attention only")
        heads = cfg["num_attention_heads"]
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            ffn_hidden_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",
            qk_norm=model_type == "qwen3",
        )

    def check_parallel(self, tp: int, pp: int) -> None:
        """ValueError (one sentence) when the model cannot be cut into ``tp`` x ``pp`` pieces."""
        for what, n in (("num_key_value_heads", self.num_kv_heads), ("num_attention_heads", self.num_heads),
                        ("intermediate_size", self.ffn_hidden_size)):
            if n % tp:
                raise ValueError(f"parallel.tp={tp} does not divide the model's {what} ({n})")
        if self.num_layers % pp:
            raise ValueError(f"parallel.pp={pp} does not divide the model's num_hidden_layers "
                             f"({self.num_layers})")

    def padded_vocab(self, tp: int) -> int:
        return -(-self.vocab_size // tp) * tp


def transformer_config(arch: HFArch, tp: int, pp: int, compute_dtype: torch.dtype = torch.float32
                       ) -> "TransformerConfig":
    """Megatron's config for ``arch``: float32 weights, no fusions, no dropout (as HF's
    inference-equivalent forward), weights initialised on the CPU (then overwritten by the HF weights),
    per-token loss (our losses already divide by the global token count), plain isend/irecv between
    stages, which exchange activations in ``compute_dtype`` (what a stage emits under autocast)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=compute_dtype,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=False,
        calculate_per_token_loss=True,
        batch_p2p_comm=False,
        # Micro-batches may hold different numbers of rows: stages exchange shapes before activations.
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # dense model; the default "allgather" refuses variable lengths
    )


def build_gpt_model(arch: HFArch, config: "TransformerConfig", *, pre_process: bool, post_process: bool
                    ) -> nn.Module:
    """GPTModel with Megatron's own layers (no Transformer Engine). Its last stage ends in the final hidden
    states: the vocab head's forward is ``HeadWeight``'s (the engine applies the weight with the fused
    log-prob kernel), the critic's is ``ValueHead``."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    model = GPTModel(
        config,
        get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm),
        vocab_size=arch.padded_vocab(config.tensor_model_parallel_size),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=arch.tie_word_embeddings and not arch.value_head,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
    )
    if arch.value_head and post_process:
        # GPTModel always builds its vocab head on the last stage; the critic swaps it for the value head
        # (the [V, H] shard is freed here), so Megatron's own forward and schedule run unchanged.
        model.output_layer = ValueHead(arch.hidden_size)
    elif post_process:
        model.output_layer = HeadWeight(model.output_layer.weight)
    return model


class HeadWeight(nn.Module):
    """``GPTModel.output_layer`` reduced to its weight: hidden [s, b, H] passes through, and the engine
    applies this rank's [V_pad / tp, H] vocabulary rows with the fused log-prob kernel (vocab-parallel
    under TP), so no [tokens x vocabulary] logits exist.

    The parameter object is the ColumnParallelLinear's (None where the weight is the embedding's, tied on
    one stage), under the same name ``output_layer.weight``: loading, export, the tied copy's gradient sum
    and the TP attributes the gradient norm reads are unchanged.
    """

    def __init__(self, weight: nn.Parameter | None):
        super().__init__()
        self.register_parameter("weight", weight)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        # GPTModel._postprocess calls output_layer(hidden, weight=..., runtime_gather_output=...), takes
        # (output, bias) and returns the output batch-first: [b, s, H].
        return hidden, None


class ValueHead(nn.Module):
    """A critic's value head in place of ``GPTModel.output_layer``: hidden [s, b, H] -> values [s, b, 1].

    Replicated over TP (not a Megatron parallel linear): without sequence parallelism every TP rank
    holds the whole final hidden state and computes the same values and loss, so its gradient is
    already complete and equal on each TP rank; the engine sums it over DP and counts it once (TP
    rank 0) in the gradient norm.
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size))  # [1, H], loaded as HF's score.weight
        self.bias = nn.Parameter(torch.zeros(1))  # [1], score.bias

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        # GPTModel._postprocess calls output_layer(hidden, weight=..., runtime_gather_output=...) and
        # takes (output, bias); weight is None because the critic never ties its head.
        return nn.functional.linear(hidden, self.weight, self.bias), None


@dataclass(frozen=True)
class Rule:
    """One Megatron parameter (``mg``, relative to the decoder layer for layer rules) and its HF tensors."""

    mg: str
    hf: tuple[str, ...]
    kind: Kind


def layer_rules(arch: HFArch) -> list[Rule]:
    """Rules of one decoder layer; HF names relative to ``model.layers.{i}.``."""
    rules = [
        Rule("input_layernorm.weight", ("input_layernorm.weight",), "replicated"),
        Rule("self_attention.linear_qkv.weight",
             ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), "qkv"),
        Rule("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), "row"),
        Rule("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), "replicated"),
        Rule("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gate_up"),
        Rule("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), "row"),
    ]
    if arch.qkv_bias:
        rules.append(Rule("self_attention.linear_qkv.bias",
                          ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), "qkv"))
    if arch.qk_norm:
        rules += [Rule("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), "replicated"),
                  Rule("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), "replicated")]
    return rules


def global_rules(arch: HFArch) -> list[Rule]:
    """Rules outside the decoder layers. A tied model's last pipeline stage holds its own copy of the
    embedding as ``output_layer.weight`` (kept equal by summing the two copies' gradients)."""
    rules = [
        Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
        Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"),
    ]
    if arch.value_head:
        return rules + [Rule("output_layer.weight", ("score.weight",), "replicated"),
                        Rule("output_layer.bias", ("score.bias",), "replicated")]
    head = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
    return rules + [Rule("output_layer.weight", (head,), "vocab")]


def _qkv_groups(arch: HFArch) -> tuple[int, int]:
    """(query groups, rows per group / head_dim) of the interleaved qkv layout."""
    return arch.num_kv_heads, arch.num_heads // arch.num_kv_heads + 2


def to_megatron(rule: Rule, hf: Sequence[torch.Tensor], arch: HFArch, tp_rank: int, tp: int) -> torch.Tensor:
    """This TP rank's shard of ``rule``'s Megatron parameter, from its full HF tensors."""
    if rule.kind == "replicated":
        return hf[0]
    if rule.kind == "row":
        return hf[0].chunk(tp, dim=1)[tp_rank]
    if rule.kind == "vocab":
        padded = hf[0].new_zeros(arch.padded_vocab(tp), *hf[0].shape[1:])  # [V_pad, H]
        padded[: arch.vocab_size] = hf[0]
        return padded.chunk(tp, dim=0)[tp_rank]
    if rule.kind == "gate_up":
        gate, up = hf
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]])
    groups, per_group = _qkv_groups(arch)
    q, k, v = (t.reshape(groups, -1, *t.shape[1:]) for t in hf)  # [ng, heads_in_group * d, (H)]
    full = torch.cat([q, k, v], dim=1).reshape(groups * per_group * arch.head_dim, *hf[0].shape[1:])
    return full.chunk(tp, dim=0)[tp_rank]


def to_hf(rule: Rule, parts: Sequence[torch.Tensor], arch: HFArch) -> list[torch.Tensor]:
    """The full HF tensors of ``rule`` from the shards of every TP rank, in TP-rank order (inverse of
    ``to_megatron``)."""
    if rule.kind == "replicated":
        return [parts[0]]
    if rule.kind == "row":
        return [torch.cat(list(parts), dim=1)]
    if rule.kind == "vocab":
        return [torch.cat(list(parts), dim=0)[: arch.vocab_size]]
    if rule.kind == "gate_up":
        halves = [p.chunk(2, dim=0) for p in parts]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    groups, per_group = _qkv_groups(arch)
    full = torch.cat(list(parts), dim=0)
    grouped = full.reshape(groups, per_group * arch.head_dim, *full.shape[1:])
    d = arch.head_dim
    q, k, v = grouped.split([(per_group - 2) * d, d, d], dim=1)
    return [t.reshape(-1, *full.shape[1:]) for t in (q, k, v)]


class HFWeights:
    """The tensors of a folder's safetensors files (sharded or not), read one at a time on demand:
    a rank loads only the weights of its own pipeline stage. ``extra`` adds tensors the folder lacks
    (a critic's freshly initialised value head)."""

    def __init__(self, path: str | Path, extra: dict[str, torch.Tensor] | None = None):
        from safetensors import safe_open

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise ValueError(f"{path}: no *.safetensors weights to load into the Megatron model")
        self._where: dict[str, object] = {}  # tensor name -> the open file that holds it
        for f in files:
            handle = safe_open(str(f), framework="pt", device="cpu")
            self._where.update({k: handle for k in handle.keys()})
        self._extra = dict(extra or {})

    def names(self) -> set[str]:
        return set(self._where) | set(self._extra)

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._extra:
            return tuple(self._extra[name].shape)
        return tuple(self._where[name].get_slice(name).get_shape())

    def __contains__(self, name: str) -> bool:
        return name in self._extra or name in self._where

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._extra:
            return self._extra[name]
        return self._where[name].get_tensor(name)


def local_rules(model: nn.Module, arch: HFArch) -> list[tuple[str, Rule, tuple[str, ...]]]:
    """``(megatron parameter name, rule, full HF names)`` of every parameter of this rank's model.

    Layers are named by their global index (``layer_number - 1``), so a later pipeline stage's
    ``decoder.layers.0`` maps to the HF layer it really is.
    """
    rules = {r.mg: (r, r.hf) for r in global_rules(arch)}
    per_layer = layer_rules(arch)
    for local, layer in enumerate(model.decoder.layers):
        i = layer.layer_number - 1
        for r in per_layer:
            rules[f"decoder.layers.{local}.{r.mg}"] = (r, tuple(f"model.layers.{i}.{h}" for h in r.hf))
    out = []
    for name, _ in model.named_parameters():
        if name not in rules:
            raise ValueError(f"Megatron parameter {name!r} has no HF conversion rule")
        rule, hf_names = rules[name]
        out.append((name, rule, hf_names))
    return out


@torch.no_grad()
def load_hf_state(model: nn.Module, hf_state: "HFWeights | dict[str, torch.Tensor]", arch: HFArch,
                  tp_rank: int, tp: int) -> None:
    """Copy this rank's shards of the HF weights into ``model`` (every local parameter is written)."""
    params = dict(model.named_parameters())
    for name, rule, hf_names in local_rules(model, arch):
        missing = [h for h in hf_names if h not in hf_state]
        if missing:
            raise ValueError(f"HF weights lack {missing[0]!r}, needed for Megatron's {name}")
        shard = to_megatron(rule, [hf_state[h] for h in hf_names], arch, tp_rank, tp)
        if shard.shape != params[name].shape:
            raise ValueError(f"{name}: HF weights give shape {tuple(shard.shape)}, the model has "
                             f"{tuple(params[name].shape)}")
        params[name].copy_(shard)
