"""What the native decoder reads from an HF ``config.json``: its sizes and architecture (``DecoderConfig``,
validated up front) and its RoPE (inverse frequencies per rope type: default, linear, dynamic NTK, llama3,
yarn; the cos / sin tables the decoder reads by position, built in fp32 as transformers builds them)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from spmdrl.config.shape import num_experts

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class DecoderConfig:
    """The subset of an HF config that the decoder needs, validated up front."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 always; Llama/Qwen3 when attention_bias
    o_bias: bool  # Llama/Qwen3 when attention_bias (Qwen2 never)
    mlp_bias: bool  # Llama's mlp_bias
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    rope_theta: float
    rope_scaling: dict = field(default_factory=dict)  # rope_parameters minus rope_theta; "rope_type" key
    # Mixture-of-Experts (qwen3_moe): every layer's MLP is num_experts SwiGLU experts of
    # moe_intermediate_size, experts_per_token of them a token (0 experts: a dense model).
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> "DecoderConfig":
        mt = cfg.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"native rollout: model_type {mt!r} in {source} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)} (rollout.engine: hf runs others)"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"native rollout: hidden_act {act!r} in {source} is not supported; only 'silu'")
        if cfg.get("use_sliding_window", False):
            raise ValueError(f"native rollout: use_sliding_window=true in {source} is not supported")
        # transformers >= 5 writes rope_parameters; older checkpoints write rope_theta + rope_scaling.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"native rollout: rope type {rope_type!r} in {source} is not supported; "
                             f"supported: {', '.join(ROPE_TYPES)}")
        if float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
            raise ValueError(f"native rollout: partial_rotary_factor != 1 in {source} is not supported")
        rope["rope_type"] = rope_type
        if rope_type in ("llama3", "yarn"):
            rope.setdefault("original_max_position_embeddings",
                            cfg.get("original_max_position_embeddings", cfg["max_position_embeddings"]))
        heads = cfg["num_attention_heads"]
        attn_bias = bool(cfg.get("attention_bias", False))
        moe = {}
        if mt == "qwen3_moe":
            if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
                raise ValueError(f"native rollout: {source} mixes dense and MoE layers (decoder_sparse_step "
                                 f"/ mlp_only_layers); the decoder takes Qwen3-MoE models whose every layer "
                                 f"is MoE")
            moe = dict(num_experts=num_experts(cfg), experts_per_token=cfg["num_experts_per_tok"],
                       moe_intermediate_size=cfg["moe_intermediate_size"],
                       norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
        return cls(
            model_type=mt,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if mt == "qwen2" else attn_bias,
            o_bias=False if mt == "qwen2" else attn_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=mt in ("qwen3", "qwen3_moe"),
            rope_theta=theta,
            rope_scaling=rope,
            **moe,
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> "DecoderConfig":
        f = Path(path) / "config.json"
        return cls.from_hf(json.loads(f.read_text()), source=str(f))

    def num_params(self) -> int:
        """Parameters as transformers counts them (tied lm_head counted once)."""
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        qkv = h * (self.num_heads + 2 * self.num_kv_heads) * d
        mlp = self.num_experts * (3 * h * self.moe_intermediate_size + h) if self.moe else 3 * h * i
        per_layer = qkv + self.num_heads * d * h + mlp + 2 * h
        per_layer += (self.num_heads + 2 * self.num_kv_heads) * d * self.qkv_bias + h * self.o_bias
        per_layer += (2 * i + h) * self.mlp_bias + 2 * d * self.qk_norm
        lm = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * per_layer + self.vocab_size * h + h + lm


def rope_inv_freq(cfg: DecoderConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] (fp32) and the cos/sin scale, per the config's rope type.

    ``dynamic`` (NTK) returns the unscaled frequencies; ``rope_tables`` rescales the
    base once from the table length when the cache is longer than
    max_position_embeddings. transformers rescales per forward from the current
    length, so the two agree exactly while sequences stay within max_position_embeddings.
    """
    d, base = cfg.head_dim, cfg.rope_theta
    p = cfg.rope_scaling
    kind = p["rope_type"]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / p["factor"], 1.0
    if kind == "dynamic":
        return inv, 1.0
    if kind == "llama3":
        factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old = p["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        return torch.where(medium, smoothed, scaled), 1.0
    # yarn: blend interpolated and extrapolated frequencies over a ramp of dimensions.
    old = p["original_max_position_embeddings"]
    factor = p.get("factor") or cfg.max_position_embeddings / old

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = p.get("attention_factor")
    if attn is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def corr_dim(rot: float) -> float:
        return (d * math.log(old / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(p.get("beta_fast") or 32), corr_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / ((high - low) or 0.001), 0, 1)
    pos_freqs = base ** (torch.arange(0, d, 2).float() / d)
    extra = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra, float(attn)


def rope_tables(cfg: DecoderConfig, length: int, device: torch.device, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos [length, D] and signed sin [length, D] so that rope(x) = x*cos + roll(x, D/2)*sin.

    roll(x, D/2) = [x2, x1]; transformers' rotate_half(x) = [-x2, x1], so the
    sign of the first half moves into the table and the step costs two fewer ops.
    """
    inv, scale = rope_inv_freq(cfg)
    if cfg.rope_scaling["rope_type"] == "dynamic" and length > cfg.max_position_embeddings:
        f, d, m = cfg.rope_scaling["factor"], cfg.head_dim, cfg.max_position_embeddings
        base = cfg.rope_theta * ((f * length / m) - (f - 1)) ** (d / (d - 2))
        inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.outer(torch.arange(length, dtype=torch.float32), inv)  # [S, D/2]
    emb = torch.cat([freqs, freqs], -1)  # [S, D]
    cos, sin = emb.cos() * scale, emb.sin() * scale
    half = cfg.head_dim // 2
    sin = torch.cat([-sin[:, :half], sin[:, half:]], -1)
    return cos.to(device, dtype), sin.to(device, dtype)
