"""Packed sequences for the FSDP2 engine: the valid tokens of a micro-batch's rows in one row, no padding.

    packed = pack(micro)                       # ids, positions, cu_seqlens, output indices
    model(**packed.model_kwargs(), ...)        # attention never crosses a sequence
    outputs at packed.keep -> reshape [n, R]   # back to the padded response layout the losses read
    local, targets = shard_packed(packed, g)   # sequence parallelism: this rank's slice (ulysses.py)

Every projection, MLP, norm and the LM head then run on the valid tokens only (verl's
``use_remove_padding``). Attention is the one place that needs sequence boundaries: the model is
loaded with ``attn_implementation=packed_attention(inner)``, a transformers attention function
registered here that scatters the packed q/k/v into [sequences, heads, longest, dim] blocks
(right-padded, so a causal mask is exactly the per-sequence mask), runs the model's own ``inner`` kernel
(eager or sdpa) on each and gathers the valid rows back. Sequences go into length buckets (``_layout``:
sorted by length, a new bucket where a sequence is under half its bucket's longest), each padded to its
own longest, so the cost is about the sum of the squared lengths, never sequences x the longest^2 (on
long-tailed prompts that was most of a forward, and the padded path's cost too) nor the packed length
squared of one block-diagonal [T, T] mask. The boundaries come from transformers' flash-attention kwargs
(``cu_seq_lens_q``), which the model passes to every attention call; the buckets are worked out once per
forward, not per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from spmdrl.batch import Batch
from spmdrl.engines.fsdp2.ulysses import SP_GROUP_ATTR, heads_for_seq, kv_heads_for, seq_for_heads

_PREFIX = "spmdrl_packed_"


@dataclass
class Packed:
    """One micro-batch of n rows packed into a row of T valid tokens."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T], restarting at each sequence
    cu_seqlens: torch.Tensor  # [n+1] int32, sequence starts in the packed row
    max_len: int  # longest sequence
    keep: torch.Tensor  # [n*R] packed index of the position predicting each response token
    last: torch.Tensor  # [n] packed index of each sequence's last token

    def model_kwargs(self) -> dict:
        return dict(
            input_ids=self.input_ids, attention_mask=None, position_ids=self.position_ids,
            cu_seq_lens_q=self.cu_seqlens, cu_seq_lens_k=self.cu_seqlens,
            max_length_q=self.max_len, max_length_k=self.max_len,
        )


def pack(micro: Batch) -> Packed:
    """The valid (attended) tokens of ``micro``'s rows concatenated, and where its outputs come from.

    Rows are laid out as ``batch.from_generation`` makes them: position ids count attended tokens
    from 0, so they restart per sequence. A response column whose token is padding points at its row's
    first token: a finite value that the response mask drops (as the padded path's value there) and that
    depends on the row alone, not on which rows share its micro-batch.
    """
    valid = micro["attention_mask"].bool()  # [n, L]
    lengths = valid.sum(1)  # [n]
    cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)  # [n+1]
    index = valid.flatten().long().cumsum(0).sub_(1).view(valid.shape)  # [n, L] packed index where valid
    # Column c predicts token c+1: the response token j is predicted by column L-R-1+j. A reward model's
    # rows have no response: it reads only each sequence's last token.
    resp = micro["response_mask"].shape[1] if "response_mask" in micro else 0
    width = valid.shape[1]
    pred, resp_cols = slice(width - resp - 1, width - 1), slice(width - resp, width)
    first = cu[:-1, None].long().clamp(max=max(int(cu[-1]) - 1, 0))  # [n, 1]
    keep = torch.where(valid[:, pred] & valid[:, resp_cols], index[:, pred], first)  # [n, R]
    return Packed(
        input_ids=micro["input_ids"][valid][None],
        position_ids=micro["position_ids"][valid][None],
        cu_seqlens=cu,
        max_len=int(lengths.max()),
        keep=keep.flatten(),
        last=cu[1:].long() - 1,
    )


def shard_packed(packed: Packed, group: dist.ProcessGroup) -> tuple[Packed, torch.Tensor]:
    """Sequence parallelism (``ulysses.py``): this rank's contiguous slice of ``packed``'s row, padded to a
    multiple of the group's size, and the targets of its tokens [1, T/sp].

    The slice keeps the whole row's boundaries (attention runs over whole sequences after the all-to-all)
    and output positions (``keep``, ``last``: read after the outputs are gathered); the padding is a
    sequence of its own, so no real token attends to it. Targets are shifted on the whole row before it is
    sliced: a slice's last token is scored against the next slice's first.
    """
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    ids, pos, cu = packed.input_ids, packed.position_ids, packed.cu_seqlens  # [1, T], [1, T], [n+1]
    total = ids.shape[1]
    pad = -total % sp
    if pad:
        ids = F.pad(ids, (0, pad))
        pos = torch.cat([pos, torch.arange(pad, device=pos.device, dtype=pos.dtype)[None]], 1)
        cu = torch.cat([cu, cu.new_tensor([total + pad])])
    targets = F.pad(ids[:, 1:], (0, 1))  # [1, T_pad]
    local = slice(rank * ids.shape[1] // sp, (rank + 1) * ids.shape[1] // sp)
    return Packed(ids[:, local], pos[:, local], cu, max(packed.max_len, pad), packed.keep,
                  packed.last), targets[:, local]


@dataclass
class _Bucket:
    """Sequences of similar length, right-padded to the longest of them: [n, longest]."""

    tokens: torch.Tensor  # [t] packed indices of the bucket's tokens
    slots: torch.Tensor  # [t] where each lands in the flattened [n * longest] block
    n: int
    longest: int


_LAYOUT: list = [None, None]  # (cu_seqlens of the forward in progress, its buckets): reused by every layer


def _layout(cu: torch.Tensor) -> list[_Bucket]:
    """The length buckets of the sequences that ``cu`` [n+1] bounds (module docstring)."""
    if _LAYOUT[0] is cu:
        return _LAYOUT[1]
    lengths = (cu[1:] - cu[:-1]).long()
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
    sizes = lengths.tolist()
    groups: list[list[int]] = []
    for i in order:
        if not groups or 2 * sizes[i] < sizes[groups[-1][0]]:
            groups.append([])
        groups[-1].append(i)
    buckets = []
    for g in groups:
        seqs = torch.tensor(g, device=cu.device)
        lens = lengths[seqs]  # [n_b]
        row = torch.repeat_interleave(torch.arange(len(g), device=cu.device), lens)  # [t]
        col = torch.arange(int(lens.sum()), device=cu.device) - F.pad(lens.cumsum(0), (1, 0))[:-1][row]
        tokens = cu[:-1].long()[seqs][row] + col
        longest = int(lens[0])
        buckets.append(_Bucket(tokens, row * longest + col, len(g), longest))
    _LAYOUT[:] = [cu, buckets]
    return buckets


def _eager(module, query, key, value, mask, scaling, dropout, **kwargs):
    """transformers' eager attention (matmul, float32 softmax) with an additive mask; [n, longest, H, D]."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling + mask
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2), None


def _sdpa(module, query, key, value, mask, scaling, dropout, **kwargs):
    """torch's sdpa, causal, with the key / value heads repeated by shape (an SP rank's share of the heads,
    which the module's own ``num_key_value_groups`` does not describe when they were repeated); [n, longest,
    H, D]."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout if module.training else 0.0,
                                         scale=scaling, is_causal=True)
    return out.transpose(1, 2), None


def _packed_attention_fn(inner: str):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *,
                  cu_seq_lens_q, **kwargs):
        kernel = _eager if inner == "eager" else sdpa_attention_forward
        group = getattr(module, SP_GROUP_ATTR, None)
        if group is not None:  # Ulysses: this rank's heads over the whole row (ulysses.py)
            heads, sp = query.shape[1], dist.get_world_size(group)
            kv = kv_heads_for(sp, heads, key.shape[1])
            query, key, value = heads_for_seq(query, group, heads), heads_for_seq(key, group, kv), \
                heads_for_seq(value, group, kv)
            kernel = _eager if inner == "eager" else _sdpa
        # query [1, H, T, D], key / value [1, Hkv, T, D]; each bucket as [n, H(kv), longest, D], right-padded
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H(kv), D]
        out = q.new_empty(q.shape)  # [T, H, D]
        for b in _layout(cu_seq_lens_q):

            def unpack(x: torch.Tensor) -> torch.Tensor:
                block = x.new_zeros(b.n * b.longest, x.shape[1], x.shape[2])
                block.index_copy_(0, b.slots, x[b.tokens])
                return block.view(b.n, b.longest, x.shape[1], x.shape[2]).transpose(1, 2)

            mask = None
            if inner == "eager":  # an additive causal mask; sdpa is causal without one
                mask = torch.full((b.longest, b.longest), torch.finfo(query.dtype).min,
                                  dtype=query.dtype, device=query.device).triu_(1)[None, None]
            o, _ = kernel(module, unpack(q), unpack(k), unpack(v), mask, scaling=scaling, dropout=dropout,
                          is_causal=True)  # [n, longest, H, D]
            out = out.index_copy(0, b.tokens, o.reshape(b.n * b.longest, *o.shape[2:])[b.slots])
        if group is not None:
            return seq_for_heads(out[None], group), None  # [1, T/sp, H, D]
        return out[None], None  # [1, T, H, D]

    return attention


def packed_attention(inner: str) -> str:
    """The registered name of the packed attention running the ``inner`` kernel ("eager" or "sdpa")."""
    from transformers import AttentionInterface

    if inner not in ("eager", "sdpa"):
        raise ValueError(f"packed sequences run on the eager or sdpa attention kernel, not {inner!r}; "
                         f"set model.attn_implementation to auto, eager or sdpa, or model.use_remove_padding "
                         f"to false")
    name = _PREFIX + inner
    AttentionInterface.register(name, _packed_attention_fn(inner))
    return name
