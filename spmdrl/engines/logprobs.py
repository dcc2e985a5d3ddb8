"""Per-token log-probs and entropy straight from the final hidden states and the LM head's weight: the fused
linear log-softmax (Liger's fused linear cross-entropy, Apple's cut-cross-entropy) every engine's forward
ends with, so no [tokens x vocabulary] tensor ever exists.

    out = token_outputs(hidden, weight, labels, temperature, with_entropy=True)  # {"logp", "entropy"}: [n, R]

``_FusedLogProbs`` walks the vocabulary in blocks of at most ``_CHUNK_ELEMENTS`` logits (every token x some
rows of the head) and makes a block's logits ``hidden @ weight[rows].T`` (compute dtype, then float32 / T)
into buffers reused by every block. Forward folds each block into per-token running sums (an online
log-sum-exp: max, sum of exps, the entropy's sum, the label's logit). The hand-written backward recomputes
each block from the saved hidden states and log-sum-exp, turns it into ``(onehot(label) - softmax) * g / T``
(plus the entropy's term for an entropy bonus), writes the block's rows of the head's gradient with one
matmul over all tokens and adds its share to the hidden-state gradient (float32, [N, H]). Blocks of the
vocabulary rather than chunks of tokens: every matmul spans all tokens, the [V, H] gradient is written once
(token chunks read and write all of it once per chunk, summing it in bf16), and TP needs no collective per
block. The entropy is a metric without gradient unless ``entropy_grad``.

Vocab-parallel heads (tensor parallelism): rank r of ``tp_group`` holds rows [r V_l, (r+1) V_l) of the
[V, H] weight. Forward all-reduces the per-token max, then the sums and the label's logit: two collectives
a call; backward all-reduces the hidden-state gradient. Rows from ``vocab`` on (Megatron pads its
vocabulary to a multiple of TP) stay out of the softmax and get no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist

# Logits per block (tokens x vocabulary rows): each float32 buffer of the kernel is 16 MiB (4,096 tokens x
# 1,024 rows). On 2 CPU cores Qwen2.5-0.5B's bf16 head over 4,096 tokens took ~12 s forward and backward
# at 2^22, no more at 2^24 (and ~13.5 s on the whole-logits path this replaced); 2^20 was slower.
_CHUNK_ELEMENTS = 1 << 22
# On a GPU each block is a handful of kernel launches whatever its size, so blocks are 32x larger (512 MiB
# float32 buffers): at 2^22 an H100 walked Qwen2.5's 151,936 rows in ~350 blocks per micro-batch of 9,600
# tokens, and the update took 3x TRL's on the same work (bench/gpu/results/2026-11-27).
_GPU_CHUNK_ELEMENTS = 1 << 27


def chunk_elements(device_type: str) -> int:
    """Most logits in one block of the kernel on ``device_type`` (the memory plan counts three buffers)."""
    return _CHUNK_ELEMENTS if device_type == "cpu" else _GPU_CHUNK_ELEMENTS


@dataclass(frozen=True)
class _Head:
    """How to read the weight: temperature, the TP group (None: the whole vocabulary is here), and this
    rank's real rows: global ids [start, start + valid)."""

    temperature: float
    group: Optional[dist.ProcessGroup]
    start: int
    valid: int


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The matmul dtype: autocast's when on (Megatron's bf16 over float32 weights), else the weight's."""
    device = weight.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


class _Blocks:
    """Flat buffers for the [n, v] logit blocks of one pass, allocated once and reused by every block: a
    fresh tensor per block pays its page faults each time (measured on a 2-core CPU with 256 MiB blocks:
    the matmul 2x and exp 4x slower than into a reused buffer)."""

    def __init__(self, numel: int, dtype: torch.dtype, n_float: int, device: torch.device):
        # The matmul's output in a low-precision compute dtype; float32 matmuls write the float32 buffer.
        self.low = torch.empty(numel, dtype=dtype, device=device) if dtype != torch.float32 else None
        self.f32 = [torch.empty(numel, dtype=torch.float32, device=device) for _ in range(n_float)]

    def logits(self, h: torch.Tensor, w: torch.Tensor, temperature: float) -> torch.Tensor:
        """float32 logits / T into buffer 0: h [n, H], w [v, H] in the compute dtype -> [n, v]."""
        x = self.buffer(0, h.shape[0], w.shape[0])
        if self.low is None:
            torch.mm(h, w.t(), out=x)
        else:
            x.copy_(torch.mm(h, w.t(), out=self.low[: x.numel()].view(x.shape)))
        return x.div_(temperature) if temperature != 1.0 else x

    def buffer(self, i: int, n: int, v: int) -> torch.Tensor:
        return self.f32[i][: n * v].view(n, v)

    def low_precision(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, v] float32 in the compute dtype (the matmul's buffer, free again by then)."""
        return x if self.low is None else self.low[: x.numel()].view(x.shape).copy_(x)


def _block_columns(n: int, device: torch.device) -> int:
    """Vocabulary rows per block for n tokens: at most ``chunk_elements`` logits a block."""
    return max(1, chunk_elements(device.type) // max(1, n))


def _in_block(local: torch.Tensor, owned: torch.Tensor, v0: int, v1: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(whether each token's label is a row of block [v0, v1), its column there, clamped in range) [N] each:
    masks instead of the labelled tokens' indices, so no block waits for the device to count them."""
    inside = owned & (local >= v0) & (local < v1)
    return inside, (local - v0).clamp(0, v1 - v0 - 1)


def _spans(total: int, step: int) -> Iterator[tuple[int, int]]:
    return ((s, min(s + step, total)) for s in range(0, total, step))


def _rebase_(sums: torch.Tensor, m: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """sums [2, N] = (sum exp(z - m), sum exp(z - m) (z - m)) re-expressed relative to top >= m, in place,
    and m set to top: exp(z - top) = exp(z - m) exp(m - top), z - top = (z - m) + (m - top)."""
    shift = m - top
    sums[1].add_(sums[0] * shift)
    sums.mul_(shift.exp())
    m.copy_(top)
    return sums


class _FusedLogProbs(torch.autograd.Function):
    """(log softmax(h W^T / T)[label], entropy) shaped like labels [...] (N of them), from hidden [N, H] and
    this rank's weight rows."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, head: _Head,
                with_entropy: bool, entropy_grad: bool):
        dtype = _compute_dtype(weight)
        n = hidden.shape[0]
        local, owned = _local_labels(labels.reshape(-1), head)
        # Per token, over the vocabulary blocks seen so far: the max logit m, sum exp(z - m),
        # sum exp(z - m) (z - m), and the label's logit (0 where another TP rank holds the label). m starts
        # at a finite floor, not -inf: the first block's rescaling of the empty sums is then 0, not NaN.
        stats = torch.zeros(4, n, dtype=torch.float32, device=hidden.device)
        m, sums, picked = stats[0].fill_(torch.finfo(torch.float32).min), stats[1:3], stats[3]
        cols = _block_columns(n, hidden.device)
        blocks = _Blocks(n * min(cols, head.valid), dtype, 2, hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):  # dtypes are explicit here
            h = hidden.to(dtype)  # [N, H]
            for v0, v1 in _spans(head.valid, cols):
                x = blocks.logits(h, weight[v0:v1].to(dtype), head.temperature)  # [N, v]
                inside, col = _in_block(local, owned, v0, v1)  # each label is in one block: picked adds once
                picked.add_(torch.where(inside, x.gather(1, col[:, None])[:, 0], 0.0))
                top = torch.maximum(m, x.amax(-1))
                x.sub_(top[:, None])
                e = torch.exp(x, out=blocks.buffer(1, *x.shape))
                _rebase_(sums, m, top)
                sums[0].add_(e.sum(-1))
                if with_entropy:
                    sums[1].add_(e.mul_(x).sum(-1))
        if head.group is not None:  # the same over the whole vocabulary: every rank's rows
            top = m.clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=head.group)
            _rebase_(sums, m, top)
            dist.all_reduce(stats[1:], group=head.group)
        log_sum = sums[0].log()
        lse = m + log_sum  # [N]
        # Outputs made in the labels' shape, not viewed into it: FSDP2 warns of (and an in-place op would
        # break) a module output that is a view.
        logp = picked.view(labels.shape) - lse.view(labels.shape)
        # log-sum-exp - sum(p z): finite even where p underflows.
        entropy = log_sum.view(labels.shape) - (sums[1] / sums[0]).view(labels.shape) if with_entropy \
            else lse.new_empty(0)
        mean_z = lse - entropy.view(-1) if entropy_grad else lse[:0]  # sum(p z), for the entropy's gradient
        ctx.save_for_backward(hidden, weight, labels, lse, mean_z)
        ctx.head, ctx.dtype, ctx.entropy_grad = head, dtype, entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, grad_entropy: torch.Tensor):
        hidden, weight, labels, lse, mean_z = ctx.saved_tensors
        head, dtype = ctx.head, ctx.dtype
        want_h, want_w = ctx.needs_input_grad[:2]
        local, owned = _local_labels(labels.reshape(-1), head)
        g, g_ent = grad_logp.reshape(-1, 1), grad_entropy.reshape(-1, 1)  # [N, 1]
        n, cols = hidden.shape[0], _block_columns(hidden.shape[0], hidden.device)
        blocks = _Blocks(n * min(cols, head.valid), dtype, 2 if ctx.entropy_grad else 1, hidden.device)
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if want_h else None
        grad_w = torch.empty_like(weight) if want_w else None
        if want_w:
            grad_w[head.valid :].zero_()  # padding rows
        with torch.autocast(hidden.device.type, enabled=False):
            h = hidden.to(dtype)  # [N, H]
            for v0, v1 in _spans(head.valid, cols):
                w = weight[v0:v1].to(dtype)  # [v, H]
                x = blocks.logits(h, w, head.temperature)  # [N, v]
                if ctx.entropy_grad:  # -p (g + g_ent (z - sum(p z))): dH/dz_j = -p_j (z_j - sum(p z))
                    p = torch.sub(x, lse[:, None], out=blocks.buffer(1, *x.shape)).exp_()
                    x.sub_(mean_z[:, None]).mul_(g_ent).add_(g).mul_(p).neg_()
                else:
                    x.sub_(lse[:, None]).exp_().mul_(-g)  # -softmax * g, in place
                inside, col = _in_block(local, owned, v0, v1)
                x.scatter_add_(1, col[:, None], torch.where(inside, g[:, 0], 0.0)[:, None])  # + onehot * g
                if head.temperature != 1.0:
                    x.div_(head.temperature)
                d = blocks.low_precision(x)  # [N, v]: the gradient of the block's logits
                if want_h:
                    grad_h.add_(torch.mm(d, w))
                if want_w:  # the block's rows of the head's gradient: one matmul over all tokens
                    if grad_w.dtype == dtype:
                        torch.mm(d.t(), h, out=grad_w[v0:v1])
                    else:  # a float32 weight under bf16 autocast (Megatron)
                        grad_w[v0:v1].copy_(torch.mm(d.t(), h))
        if want_h:
            if head.group is not None:  # each rank's vocabulary rows contribute
                dist.all_reduce(grad_h, group=head.group)
            grad_h = grad_h.to(hidden.dtype)
        return grad_h, grad_w, None, None, None, None


def _local_labels(labels: torch.Tensor, head: _Head) -> tuple[torch.Tensor, torch.Tensor]:
    """(row of each label in this rank's weight, clamped in range; whether this rank holds it) [N] each."""
    local = labels - head.start
    owned = (local >= 0) & (local < head.valid)
    return local.clamp(0, max(head.valid - 1, 0)), owned


def token_outputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool = False,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    vocab: Optional[int] = None,
) -> dict[str, torch.Tensor]:
    """{"logp", optional "entropy"} float32 shaped like ``labels`` from the hidden states that predict them.

    hidden [..., H] (``labels.numel()`` rows) and weight [V_l, H], the LM head's rows on this rank of
    ``tp_group`` (all of them without TP), in the same dtype or under autocast; labels [...] global token
    ids. Rows at global index ``vocab`` and beyond are padding. The entropy carries a gradient only with
    ``entropy_grad`` (an entropy bonus); otherwise it is a metric computed in the same pass.
    """
    rows = weight.shape[0]
    start = rows * (dist.get_rank(tp_group) if tp_group is not None else 0)
    valid = rows if vocab is None else min(rows, max(0, vocab - start))
    if valid < 1:
        raise ValueError(f"the LM head's rows {start}..{start + rows - 1} on this TP rank are all padding "
                         f"(vocabulary {vocab}); use fewer TP ranks")
    head = _Head(float(temperature), tp_group, start, valid)
    flat = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    logp, entropy = _FusedLogProbs.apply(flat, weight, labels, head, with_entropy,
                                         with_entropy and entropy_grad)
    return {"logp": logp, "entropy": entropy} if with_entropy else {"logp": logp}
