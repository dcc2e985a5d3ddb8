"""The native rollout engine's decoder: Llama / Qwen2 / Qwen3 / Qwen3-MoE as plain tensors, from an HF
``config.json``.

No ``nn.Module``: the engine only runs inference, and a handful of fused tensors
keeps per-step Python overhead low on CPU. Layout decisions, each for speed:

- q/k/v projections are one matmul (``qkv``: rows q | k | v) and gate/up are one
  matmul (``gate_up``: rows gate | up); the HF tensors are copied into row slices.
- All weights are views into ONE flat buffer (``WeightStore``), so sleep/wake frees,
  offloads or restores a single storage while every view stays valid, and
  ``update_weights`` is an in-place ``copy_`` into a view: no reallocation.
- The KV cache (cache.py) is one contiguous ``[L, rows, kv_heads, seq, head_dim]``
  view per K and V; rows can be moved in one indexed copy for all layers at once.

Numerics follow transformers (RMSNorm in fp32, RoPE tables built in fp32 and cast
to the weight dtype, softmax in fp32) so fp32 logits agree to ~1e-6.

With ``kernels`` on (kernels.py), RMSNorm and everything between the qkv
and output matmuls of a decode step run as C++ kernels; the torch code below is
the fallback and the reference they are tested against.

On a GPU a decode step is launch-bound (graphs.py), so there it takes fewer, larger
kernels: attention is one SDPA call per layer and the residual adds ride in the
output and down GEMMs. With graphs.py's cheaper log-prob, that took a step from 632
to 525 kernels and from 2.97 to 2.56 ms under CUDA graphs (128 rows of the
Qwen2.5-0.5B shape, H100).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from spmdrl.rollout.native.cache import KVCache, KVView
from spmdrl.rollout.native.config import DecoderConfig, rope_tables
from spmdrl.rollout.native.kernels import ops as _KERNELS
from spmdrl.rollout.weight_store import WeightStore

# oneDNN linear on a prepacked weight (bound once: resolving torch.ops per call costs time per step);
# None on builds without it (Decoder.pack is then never called, see precision.can_prepack).
_PACKED_LINEAR = (getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available()
                  else None)


@dataclass
class Layer:
    ln1: torch.Tensor  # [h]
    qkv_w: torch.Tensor  # [(H+2K)*D, h] rows q | k | v
    qkv_b: Optional[torch.Tensor]
    q_norm: Optional[torch.Tensor]  # [D]
    k_norm: Optional[torch.Tensor]  # [D]
    o_w: torch.Tensor  # [h, H*D]
    o_b: Optional[torch.Tensor]
    ln2: torch.Tensor  # [h]
    gu_w: Optional[torch.Tensor]  # [2I, h] rows gate | up (None in an MoE layer)
    gu_b: Optional[torch.Tensor]
    down_w: Optional[torch.Tensor]  # [h, I]
    down_b: Optional[torch.Tensor]
    # What the matmuls use: the dense views above, or their oneDNN-packed copies (Decoder.pack).
    qkv: Optional[torch.Tensor] = None
    o: Optional[torch.Tensor] = None
    gu: Optional[torch.Tensor] = None
    down: Optional[torch.Tensor] = None
    # Packed gate and up halves, for oneDNN's fused silu / multiply epilogues (None when unpacked).
    gate: Optional[torch.Tensor] = None
    up: Optional[torch.Tensor] = None
    # An MoE layer's MLP (DecoderConfig.moe): the router and every expert's SwiGLU, experts first.
    router: Optional[torch.Tensor] = None  # [E, h]
    experts_gu: Optional[torch.Tensor] = None  # [E, 2I', h] rows gate | up (I' = moe_intermediate_size)
    experts_down: Optional[torch.Tensor] = None  # [E, h, I']


def _buffer_plan(c: DecoderConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of the decoder's flat buffer, in buffer order: HF names, except the fused
    ``qkv`` / ``gate_up`` matrices and an MoE layer's ``experts.gate_up`` / ``experts.down`` stacks."""
    h, d, i = c.hidden_size, c.head_dim, c.intermediate_size
    nq, nkv = c.num_heads * d, c.num_kv_heads * d
    plan: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (c.vocab_size, h))]
    for li in range(c.num_layers):
        p = f"model.layers.{li}."
        plan += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.qkv.weight", (nq + 2 * nkv, h))]
        if c.qkv_bias:
            plan.append((p + "self_attn.qkv.bias", (nq + 2 * nkv,)))
        if c.qk_norm:
            plan += [(p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,))]
        plan.append((p + "self_attn.o_proj.weight", (h, nq)))
        if c.o_bias:
            plan.append((p + "self_attn.o_proj.bias", (h,)))
        plan.append((p + "post_attention_layernorm.weight", (h,)))
        if c.moe:
            E, im = c.num_experts, c.moe_intermediate_size
            plan += [(p + "mlp.gate.weight", (E, h)), (p + "mlp.experts.gate_up", (E, 2 * im, h)),
                     (p + "mlp.experts.down", (E, h, im))]
            continue
        plan.append((p + "mlp.gate_up.weight", (2 * i, h)))
        if c.mlp_bias:
            plan.append((p + "mlp.gate_up.bias", (2 * i,)))
        plan.append((p + "mlp.down_proj.weight", (h, i)))
        if c.mlp_bias:
            plan.append((p + "mlp.down_proj.bias", (h,)))
    plan.append(("model.norm.weight", (h,)))
    if not c.tie_word_embeddings:
        plan.append(("lm_head.weight", (c.vocab_size, h)))
    return plan


class Decoder:
    """Inference-only decoder with a caller-owned KV cache (see ``KVCache``)."""

    def __init__(self, cfg: DecoderConfig, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32):
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        c = cfg
        d, i = c.head_dim, c.intermediate_size
        nq, nkv = c.num_heads * d, c.num_kv_heads * d
        plan = _buffer_plan(c)
        # One flat buffer; offsets rounded to 64 elements keep every matrix cache-line aligned.
        offsets, total = [], 0
        for _, shape in plan:
            offsets.append(total)
            total += -(-math.prod(shape) // 64) * 64
        flat = torch.empty(total, device=self.device, dtype=dtype)
        t = {name: flat[o:o + math.prod(s)].view(s) for (name, s), o in zip(plan, offsets)}
        self.flat = flat
        self.embed = t["model.embed_tokens.weight"]
        self.norm = t["model.norm.weight"]
        self.lm_head = self.embed if c.tie_word_embeddings else t["lm_head.weight"]
        slots = {n: v for n, v in t.items() if ".qkv." not in n and ".gate_up." not in n
                 and ".experts." not in n}
        self.layers: list[Layer] = []
        for li in range(c.num_layers):
            p = f"model.layers.{li}."
            g = lambda k: t.get(p + k)  # noqa: E731
            L = Layer(g("input_layernorm.weight"), g("self_attn.qkv.weight"), g("self_attn.qkv.bias"),
                      g("self_attn.q_norm.weight"), g("self_attn.k_norm.weight"),
                      g("self_attn.o_proj.weight"), g("self_attn.o_proj.bias"),
                      g("post_attention_layernorm.weight"), g("mlp.gate_up.weight"), g("mlp.gate_up.bias"),
                      g("mlp.down_proj.weight"), g("mlp.down_proj.bias"), router=g("mlp.gate.weight"),
                      experts_gu=g("mlp.experts.gate_up"), experts_down=g("mlp.experts.down"))
            self.layers.append(L)
            if c.moe:  # checkpoint names, one tensor an expert (hf_folder.per_expert splits fused ones)
                im = c.moe_intermediate_size
                for e in range(c.num_experts):
                    q = p + f"mlp.experts.{e}."
                    slots[q + "gate_proj.weight"] = L.experts_gu[e, :im]
                    slots[q + "up_proj.weight"] = L.experts_gu[e, im:]
                    slots[q + "down_proj.weight"] = L.experts_down[e]
            # update_weights copies each HF tensor into its rows of the fused matrix.
            for kind, fused in (("weight", L.qkv_w), ("bias", L.qkv_b)):
                if fused is not None:
                    slots[p + f"self_attn.q_proj.{kind}"] = fused[:nq]
                    slots[p + f"self_attn.k_proj.{kind}"] = fused[nq:nq + nkv]
                    slots[p + f"self_attn.v_proj.{kind}"] = fused[nq + nkv:]
            for kind, fused in (("weight", L.gu_w), ("bias", L.gu_b)):
                if fused is not None:
                    slots[p + f"mlp.gate_proj.{kind}"] = fused[:i]
                    slots[p + f"mlp.up_proj.{kind}"] = fused[i:]
        optional = ()
        if c.tie_word_embeddings:
            slots["lm_head.weight"] = self.embed  # a tied checkpoint may still carry it
            optional = ("lm_head.weight",)
        self.weights = WeightStore([flat], slots, optional)
        self.scale = 1.0 / math.sqrt(d)
        # C++ decode kernels (kernels.py); the engine turns them on after they load.
        self.kernels = False
        self.packed = False
        # MoE routing record (Decoder._moe): the engine sets record_routes and takes them after a forward.
        self.record_routes = False
        self.routes: list[torch.Tensor] = []
        self.unpack()

    # ---- prepacked matmul weights ----------------------------------------------------------------

    def pack(self) -> None:
        """Give every matmul a oneDNN-packed copy of its weight (CPU; see ``precision.can_prepack``).

        F.linear re-lays out a plain weight on every call; packing once measured
        21-32% faster decode GEMMs (bf16, 38M / 4.5M models, 1 thread) and more
        in fp32. The copies are derived state, like the KV cache: the dense
        weights stay the master that update_weights writes, and the engine
        repacks after an update and drops the copies on sleep.
        """
        reorder = torch.ops.mkldnn._reorder_linear_weight
        i = self.cfg.intermediate_size
        for L in self.layers:
            L.qkv, L.o = reorder(L.qkv_w, None), reorder(L.o_w, None)
            if L.router is not None:  # experts run on a few rows each (_moe): plain matmuls
                continue
            L.down = reorder(L.down_w, None)
            if L.gu_b is None:  # the fused-epilogue MLP of _out_mlp
                L.gate, L.up = reorder(L.gu_w[:i], None), reorder(L.gu_w[i:], None)
            else:  # an MLP bias: the plain path with the fused gate|up matrix
                L.gu = reorder(L.gu_w, None)
        self.head = reorder(self.lm_head, None)
        self.packed = True

    def unpack(self) -> None:
        for L in self.layers:
            L.qkv, L.o, L.gu, L.down = L.qkv_w, L.o_w, L.gu_w, L.down_w
            L.gate = L.up = None
        self.head = self.lm_head
        self.packed = False

    def packed_nbytes(self) -> int:
        if not self.packed:
            return 0
        mats = [self.head] + [w for L in self.layers for w in (L.qkv, L.o) + (
            () if L.router is not None else (L.down, L.gate, L.up) if L.gu_b is None else (L.down, L.gu))]
        return sum(w.numel() * w.element_size() for w in mats)  # opaque tensors expose no storage

    def _linear(self, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.packed:
            return _PACKED_LINEAR(x, w, b, "none", [], "")
        return F.linear(x, w, b)

    # ---- loading ---------------------------------------------------------------------------------

    @staticmethod
    def iter_checkpoint(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) from a folder's safetensors (single file or sharded index), one at a time."""
        from safetensors import safe_open

        path = Path(path)
        index = path / "model.safetensors.index.json"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (path / "model.safetensors").exists():
            files = ["model.safetensors"]
        else:
            raise FileNotFoundError(
                f"native rollout: no model.safetensors or model.safetensors.index.json in {path}")
        for fname in files:
            with safe_open(str(path / fname), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    def new_cache(self, rows: int, seq: int) -> KVCache:
        """A zeroed KV cache for ``rows`` sequences of ``seq`` tokens, with RoPE tables for ``seq``."""
        c = self.cfg
        cos, sin = rope_tables(c, seq, self.device, self.dtype)
        return KVCache((c.num_layers, rows, c.num_kv_heads, seq, c.head_dim), cos, sin)

    # ---- forward ---------------------------------------------------------------------------------

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.kernels:  # two passes, transformers' arithmetic exactly
            return _KERNELS.rms_norm(x, w, self.cfg.rms_norm_eps)
        # One fused op; it accumulates in fp32 for bf16 inputs, like transformers, but
        # scales by the weight before rounding (transformers rounds first): bf16 results
        # may differ in the last bit, fp32 results are identical.
        return F.rms_norm(x, w.shape, w, self.cfg.rms_norm_eps)

    def _qkv(self, L: Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., h] -> q [..., H, D], k [..., K, D], v [..., K, D], RoPE applied (cos/sin [..., 1, D])."""
        c = self.cfg
        H, K, D = c.num_heads, c.num_kv_heads, c.head_dim
        qkv = self._linear(self._rms(x, L.ln1), L.qkv, L.qkv_b).unflatten(-1, (H + 2 * K, D))
        qk, v = qkv.split((H + K, K), -2)
        if c.qk_norm:
            q, k = qk.split((H, K), -2)
            qk = torch.cat([self._rms(q, L.q_norm), self._rms(k, L.k_norm)], -2)
        qk = torch.addcmul(qk * cos, qk.roll(D // 2, -1), sin)  # one RoPE pass for q and k together
        q, k = qk.split((H, K), -2)
        return q, k, v

    def _out_mlp(self, L: Layer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection + residual, then the SwiGLU MLP (or the layer's experts) + residual."""
        if L.router is not None:
            x = x + self._linear(attn, L.o, L.o_b)
            return x + self._moe(L, self._rms(x, L.ln2))
        if self.packed and L.gu_b is None:
            # oneDNN epilogues fuse silu, the gate*up product and both residual adds into the
            # matmuls: 4 ops instead of 8 (~6% faster block at decode sizes in a microbenchmark).
            x = _PACKED_LINEAR.binary(attn, x, L.o, L.o_b, "add")
            h = self._rms(x, L.ln2)
            act = _PACKED_LINEAR.binary(h, _PACKED_LINEAR(h, L.gate, None, "swish", [], ""), L.up, None,
                                        "mul")
            return _PACKED_LINEAR.binary(act, x, L.down, L.down_b, "add")
        if x.is_cuda and x.dim() == 2 and L.o_b is None and L.down_b is None:
            # A decode step on a GPU: the residual adds ride in the GEMMs (beta=1), two launches fewer.
            x = torch.addmm(x, attn, L.o.t())
            gate, up = self._linear(self._rms(x, L.ln2), L.gu, L.gu_b).chunk(2, -1)
            return torch.addmm(x, F.silu(gate) * up, L.down.t())
        x = x + self._linear(attn, L.o, L.o_b)
        gate, up = self._linear(self._rms(x, L.ln2), L.gu, L.gu_b).chunk(2, -1)
        return x + self._linear(F.silu(gate) * up, L.down, L.down_b)

    def _moe(self, L: Layer, h: torch.Tensor) -> torch.Tensor:
        """h [..., hidden] -> the weighted sum of each token's routed experts, as the trainer computes it
        (``engines/fsdp2/moe.py``): router logits in fp32, softmax, top-k, renormalised with
        norm_topk_prob. Each token's experts go to ``self.routes`` when ``record_routes`` is set."""
        c = self.cfg
        x = h.reshape(-1, h.shape[-1])  # [T, h]
        probs = torch.softmax(F.linear(x.float(), L.router.float()), -1)  # [T, E]
        weights, experts = torch.topk(probs, c.experts_per_token, dim=-1)  # [T, k]
        if c.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)
        if self.record_routes:
            self.routes.append(experts)
        out = torch.zeros_like(x)
        for e in torch.unique(experts).tolist():
            tok, slot = (experts == e).nonzero(as_tuple=True)  # the tokens routed to expert e
            gate, up = F.linear(x[tok], L.experts_gu[e]).chunk(2, -1)
            y = F.linear(F.silu(gate) * up, L.experts_down[e]) * weights[tok, slot, None]
            out.index_add_(0, tok, y)
        return out.view_as(h)

    def take_routes(self) -> torch.Tensor:
        """[T, L, k] the experts of the tokens of the last forward (``record_routes``), token order as its
        input's flattened leading dims."""
        routes, self.routes = self.routes, []
        return torch.stack(routes, -2)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head in fp32: hidden [..., h] -> [..., V]."""
        return self._linear(self._rms(hidden, self.norm), self.head).float()

    def prefill(self, ids: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor,
                cache: Optional[KVView] = None) -> torch.Tensor:
        """Run left-padded prompts; write K/V into cache rows [0, B) columns [0, T). Returns hidden [B, T, h].

        ids, pos [B, T] int64, valid [B, T] bool (False on padding). Padding
        queries attend to themselves only, so no softmax row is empty (NaN-free).
        """
        B, T = ids.shape
        cos, sin = rope_tables(self.cfg, int(pos.max()) + 1, self.device, self.dtype) if cache is None \
            else (cache.cos, cache.sin)
        cos, sin = cos[pos].unsqueeze(-2), sin[pos].unsqueeze(-2)  # [B, T, 1, D]
        eye = torch.eye(T, dtype=torch.bool, device=self.device)
        mask = (torch.ones(T, T, dtype=torch.bool, device=self.device).tril() & valid[:, None, :]) | eye
        mask = mask.unsqueeze(1)  # [B, 1, T, T]
        x = F.embedding(ids, self.embed)
        for li, L in enumerate(self.layers):
            q, k, v = self._qkv(L, x, cos, sin)  # [B, T, n, D]
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, n, T, D]
            if cache is not None:
                cache.k[li, :B, :, :T] = k
                cache.v[li, :B, :, :T] = v
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
            x = self._out_mlp(L, x, a.transpose(1, 2).flatten(2))
        return x

    def extend(self, ids: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, cache: KVView, start: int
               ) -> torch.Tensor:
        """Prefill the last columns [start, T) of left-padded rows whose K/V for columns [0, start) are
        already in cache rows [0, B). ids, pos [B, T-start]; valid [B, T] bool. Returns hidden
        [B, T-start, h].

        Each query attends to the valid columns up to its own (and a padding query to itself only), as in
        ``prefill``, so the result equals a full prefill of the rows.
        """
        B, Ts = ids.shape
        T = start + Ts
        cos, sin = cache.cos[pos].unsqueeze(-2), cache.sin[pos].unsqueeze(-2)  # [B, Ts, 1, D]
        cols = torch.arange(T, device=self.device)
        own = cols[None, :] == cols[start:, None]  # [Ts, T]
        mask = ((cols[None, :] <= cols[start:, None]) & valid[:, None, :]) | own  # [B, Ts, T]
        mask = mask.unsqueeze(1)  # [B, 1, Ts, T]
        x = F.embedding(ids, self.embed)
        for li, L in enumerate(self.layers):
            q, k, v = self._qkv(L, x, cos, sin)  # [B, Ts, n, D]
            cache.k[li, :B, :, start:T] = k.transpose(1, 2)
            cache.v[li, :B, :, start:T] = v.transpose(1, 2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), cache.k[li, :B, :, :T],
                                               cache.v[li, :B, :, :T], attn_mask=mask, scale=self.scale,
                                               enable_gqa=True)
            x = self._out_mlp(L, x, a.transpose(1, 2).flatten(2))
        return x

    def decode(self, tokens: torch.Tensor, pos: torch.Tensor, cache: KVView, col: int | torch.Tensor, B: int
               ) -> torch.Tensor:
        """One token for each of the first B rows: tokens, pos [B]; K/V written at column ``col``.

        Returns logits [B, V] fp32. Attention is two batched matmuls per layer
        with q grouped as [B*K, H/K, D], so GQA never repeats K/V. Rows [0, B) of a
        contiguous cache view are contiguous, so bmm reads them in place; the
        columns past ``col`` are masked by the bias (see KVCache for why).
        On a GPU, where the step is launch-bound, the same grouping runs as one fused SDPA kernel
        per layer (K heads of H/K one-token queries) instead of six.
        ``col`` as a [1] tensor (the fixed-shape step of graphs.py) takes the torch ops, also with kernels on.
        """
        c = self.cfg
        if self.kernels and isinstance(col, int):
            return self._decode_kernels(tokens, pos, cache, col, B)
        L_, K, D = c.num_layers, c.num_kv_heads, c.head_dim
        G, S = c.num_heads // K, cache.k.shape[3]
        cos, sin = cache.cos[pos].unsqueeze(-2), cache.sin[pos].unsqueeze(-2)  # [B, 1, D]
        fused = cache.k.is_cuda
        if fused:  # [B, K, G, S] in q's dtype, as SDPA's fused kernels take it (-inf stays -inf)
            mask = cache.bias[:B].to(self.dtype)[:, None, None, :].expand(B, K, G, S)
        else:  # [B*K, 1, S]: row b's bias repeated for its K heads, broadcast over their G query heads.
            bias = cache.bias[:B].repeat_interleave(K, 0).unsqueeze(1)
        # Per-layer [B*K, S, D] views built with two calls per step instead of several per layer.
        ks = cache.k[:, :B].view(L_, B * K, S, D).unbind(0)
        vs = cache.v[:, :B].view(L_, B * K, S, D).unbind(0)
        x = F.embedding(tokens, self.embed)  # [B, h]
        for L, kc, vc in zip(self.layers, ks, vs):
            q, k, v = self._qkv(L, x, cos, sin)  # [B, H, D], [B, K, D], [B, K, D]
            if isinstance(col, int):
                kc.view(B, K, S, D)[:, :, col] = k  # one strided copy each, no reshape copy first
                vc.view(B, K, S, D)[:, :, col] = v
            else:  # a tensor column: indexing with it would read it on the host
                kc.view(B, K, S, D).index_copy_(2, col, k.unsqueeze(2))
                vc.view(B, K, S, D).index_copy_(2, col, v.unsqueeze(2))
            if fused:
                a = F.scaled_dot_product_attention(q.view(B, K, G, D), kc.view(B, K, S, D),
                                                   vc.view(B, K, S, D), attn_mask=mask,
                                                   scale=self.scale)  # [B, K, G, D]
            else:
                s = torch.bmm(q.reshape(B * K, G, D), kc.transpose(1, 2))  # [B*K, G, S]
                p = torch.softmax(torch.add(bias, s, alpha=self.scale), -1).to(self.dtype)  # scores in fp32
                a = torch.bmm(p, vc)  # [B*K, G, D]
            x = self._out_mlp(L, x, a.reshape(B, K * G * D))
        return self.logits(x)

    def _decode_kernels(self, tokens: torch.Tensor, pos: torch.Tensor, cache: KVView, col: int, B: int
                        ) -> torch.Tensor:
        """``decode`` with the C++ kernels: per layer rms_norm, the qkv matmul, one decode_attention call
        (q/k-norm, RoPE, K/V write, attention), then the output/MLP matmuls."""
        c = self.cfg
        x = F.embedding(tokens, self.embed)  # [B, h]
        bias = cache.bias[:B]
        for L, kc, vc in zip(self.layers, cache.k[:, :B].unbind(0), cache.v[:, :B].unbind(0)):  # [B, K, S, D]
            qkv = self._linear(self._rms(x, L.ln1), L.qkv, L.qkv_b)  # [B, (H+2K)*D]
            a = _KERNELS.decode_attention(qkv, L.q_norm, L.k_norm, c.rms_norm_eps, cache.cos, cache.sin, pos,
                                          kc, vc, bias, col, c.num_heads, self.scale)  # [B, H*D]
            x = self._out_mlp(L, x, a)
        return self.logits(x)
