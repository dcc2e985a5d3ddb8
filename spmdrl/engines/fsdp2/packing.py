"""Packed sequences for the FSDP2 engine: the valid tokens of a micro-batch's rows in one row, no padding.

    packed = pack(micro)                       # ids, positions, cu_seqlens, output indices
    model(**packed.model_kwargs(), ...)        # attention never crosses a sequence
    outputs at packed.keep -> reshape [n, R]   # back to the padded response layout the losses read

Every projection, MLP, norm and the LM head then run on the valid tokens only (verl's
``use_remove_padding``). Attention is the one place that needs sequence boundaries: the model is
loaded with ``attn_implementation=packed_attention(inner)``, a transformers attention function
registered here that scatters the packed q/k/v into [sequences, heads, longest, dim] (right-padded,
so a causal mask is exactly the per-sequence mask), runs the model's own ``inner`` kernel (eager or
sdpa) and gathers the valid rows back. Its cost is sequences x longest^2, never the packed length
squared that one block-diagonal [T, T] mask would cost. The boundaries come from transformers'
flash-attention kwargs (``cu_seq_lens_q``, ``max_length_q``), which the model passes to every
attention call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spmdrl.batch import Batch

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


def _pad_index(cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, column) of every packed token; [T] each."""
    lengths = (cu[1:] - cu[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), lengths)
    col = torch.arange(int(cu[-1]), device=cu.device) - cu[:-1].long()[seq]
    return seq, col


def _eager(module, query, key, value, mask, scaling, dropout, **kwargs):
    """transformers' eager attention (matmul, float32 softmax) with an additive mask; [n, longest, H, D]."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling + mask
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2), None


def _packed_attention_fn(inner: str):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kernel = _eager if inner == "eager" else sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *,
                  cu_seq_lens_q, max_length_q, **kwargs):
        # query [1, H, T, D], key / value [1, Hkv, T, D] -> [n, H(kv), longest, D], right-padded
        seq, col = _pad_index(cu_seq_lens_q)
        n = len(cu_seq_lens_q) - 1

        def unpack(x: torch.Tensor) -> torch.Tensor:
            out = x.new_zeros(n, x.shape[1], max_length_q, x.shape[3])
            out[seq, :, col] = x[0].transpose(0, 1)  # [T, H, D] into [n, H, longest, D]
            return out

        mask = None
        if inner == "eager":  # an additive causal mask; sdpa is causal without one
            mask = torch.full((max_length_q, max_length_q), torch.finfo(query.dtype).min,
                              dtype=query.dtype, device=query.device).triu_(1)[None, None]
        out, _ = kernel(module, unpack(query), unpack(key), unpack(value), mask, scaling=scaling,
                        dropout=dropout, is_causal=True)  # [n, longest, H, D]
        return out[seq, col][None], None  # [1, T, H, D]

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
