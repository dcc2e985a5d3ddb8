"""A decoder's sizes from its config.json, read before any model exists: what the memory plan multiplies.

    shape = ModelShape.of("builtin:tiny")             # or a Hugging Face folder
    shape.params, shape.layer_params, shape.head_params, shape.kv_bytes_per_token(2)

Llama / Qwen2 / Qwen3 family: attention with grouped key/value heads (Qwen2's q/k/v biases), a SwiGLU MLP,
two RMSNorms per layer, tied or untied LM head; Qwen3-MoE's layers replace the MLP with a router and
``num_experts`` SwiGLU experts, of which each token runs ``num_experts_per_tok``. A ``builtin:`` name reads
its built-in sizes (``spmdrl.builtin.models.builtin_config``), so nothing is built for a plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spmdrl.errors import ConfigError


@dataclass(frozen=True)
class ModelShape:
    hidden: int  # H
    layers: int  # L
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # I, the MLP's width a token runs through (MoE: its experts' together)
    vocab: int  # V
    tied: bool  # the LM head is the embedding matrix
    qkv_bias: bool
    qk_norm: bool = False  # Qwen3: an RMSNorm over head_dim on q and on k
    experts: int = 0  # MoE: experts per layer (0: a dense MLP)
    expert_intermediate: int = 0  # MoE: one expert's width

    @classmethod
    def of(cls, path: str) -> "ModelShape":
        """The shape of the model at ``path`` (a folder with config.json, or ``builtin:<name>``)."""
        if path.startswith("builtin:"):
            from spmdrl.builtin.models import builtin_config

            return cls.from_config(builtin_config(path))
        from spmdrl.config.model_folder import read_config, text_config

        return cls.from_config(text_config(read_config(path, "model.path")))

    @classmethod
    def from_config(cls, c: dict[str, Any]) -> "ModelShape":
        heads = c["num_attention_heads"]
        moe = _moe(c)
        return cls(hidden=c["hidden_size"], layers=c["num_hidden_layers"], heads=heads,
                   kv_heads=c.get("num_key_value_heads") or heads,
                   head_dim=c.get("head_dim") or c["hidden_size"] // heads,
                   intermediate=(c["num_experts_per_tok"] * c["moe_intermediate_size"] if moe
                                 else c["intermediate_size"]),
                   vocab=c["vocab_size"], tied=bool(c.get("tie_word_embeddings", False)),
                   qkv_bias=bool(c.get("attention_bias", c.get("model_type") == "qwen2")),
                   qk_norm=c.get("model_type") in ("qwen3", "qwen3_moe"),
                   experts=num_experts(c) if moe else 0,
                   expert_intermediate=c["moe_intermediate_size"] if moe else 0)

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: q, k, v, o (Qwen3: their q / k norms), two norms, and gate, up,
        down (MoE: each expert's, and the router)."""
        H, kv = self.hidden, self.kv_heads * self.head_dim
        q = self.heads * self.head_dim
        attn = H * q + 2 * H * kv + q * H + ((q + 2 * kv) if self.qkv_bias else 0) + \
            (2 * self.head_dim if self.qk_norm else 0)
        if self.experts:
            return attn + self.experts * 3 * H * self.expert_intermediate + H * self.experts + 2 * H
        return attn + 3 * H * self.intermediate + 2 * H

    @property
    def head_params(self) -> int:
        """The LM head's own parameters (0 when tied to the embeddings)."""
        return 0 if self.tied else self.vocab * self.hidden

    @property
    def root_params(self) -> int:
        """What is not in a decoder layer: embeddings, final norm and an untied LM head."""
        return self.vocab * self.hidden + self.hidden + self.head_params

    @property
    def params(self) -> int:
        """Parameters of the causal LM (a tied head counted once)."""
        return self.layers * self.layer_params + self.root_params

    @property
    def backbone_params(self) -> int:
        """The decoder without an LM head (a critic's or reward model's trunk; their head is H + 1)."""
        return self.layers * self.layer_params + self.vocab * self.hidden + self.hidden

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """Each decoder layer's linear layers by their Hugging Face name: (in_features, out_features)."""
        H, q, kv, inter = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, \
            self.intermediate
        return {"q_proj": (H, q), "k_proj": (H, kv), "v_proj": (H, kv), "o_proj": (q, H),
                "gate_proj": (H, inter), "up_proj": (H, inter), "down_proj": (inter, H)}

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of every layer for one token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def lora_params(self, rank: int) -> int:
        """Adapter parameters of rank ``rank`` on every linear layer of the decoder (peft's all-linear)."""
        h, m = self.hidden, self.intermediate
        kv, q = self.kv_heads * self.head_dim, self.heads * self.head_dim
        per_layer = sum(rank * (i + o) for i, o in ((h, q), (h, kv), (h, kv), (q, h), (h, m), (h, m), (m, h)))
        return self.layers * per_layer


def num_experts(c: dict[str, Any]) -> int:
    """Experts per layer of an HF config (0: dense). transformers 5 writes ``num_experts`` as
    ``num_local_experts`` when it saves a Qwen3-MoE config; released checkpoints have ``num_experts``."""
    return int(c.get("num_experts") or c.get("num_local_experts") or 0)


def _moe(c: dict[str, Any]) -> bool:
    """Whether ``c`` is a Qwen3-MoE decoder whose every layer is sparse (as its released models are); one
    that mixes dense and sparse layers is refused (ConfigError: the run stops with one sentence), as the
    plan would misjudge it. Other MoE architectures (Qwen2-MoE's shared expert) are read as before, by
    their dense ``intermediate_size``."""
    if c.get("model_type") != "qwen3_moe" or not num_experts(c):
        return False
    if c.get("decoder_sparse_step", 1) != 1 or c.get("mlp_only_layers"):
        raise ConfigError(f"{c.get('model_type')} with decoder_sparse_step {c.get('decoder_sparse_step')} "
                         f"and mlp_only_layers {c.get('mlp_only_layers')} mixes dense and MoE layers, which "
                         f"spmdrl does not plan for; every layer must be sparse (decoder_sparse_step 1, no "
                         f"mlp_only_layers)")
    return True
