"""Per-token log-probs and entropy from logits: the kernel every engine's forward ends with.

    out = token_outputs(logits, labels, temperature, with_entropy=True)  # {"logp", "entropy"}: [n, R] each

``token_logprobs`` is a row-chunked autograd function (``_TokenLogProbs``) with a hand-written
backward, so neither the float32 log-softmax of the whole [N, V] block nor autograd's dense
gradients of it ever exist; ``entropy_from_logits`` is the differentiable entropy an entropy
bonus needs.
"""

from __future__ import annotations

from typing import Optional

import torch

# Rows of the [rows, V] logits processed at once by the log-prob / entropy
# helpers: bounds the float32 temporaries to about 256 MiB whatever the vocabulary.
_CHUNK_ELEMENTS = 1 << 26


def _row_chunks(flat: torch.Tensor) -> int:
    return max(1, _CHUNK_ELEMENTS // max(1, flat.shape[-1]))


class _TokenLogProbs(torch.autograd.Function):
    """log_softmax(logits / T)[label] (and, without gradient, the entropy) over [N, V], row-chunked.

    One fused ``log_softmax`` per chunk instead of logsumexp's several passes, and
    a hand-written backward, ``(onehot(label) - softmax) * g / T`` computed chunk
    by chunk from the saved logits and per-row logsumexp: autograd's version
    materialises a dense [N, V] gradient of the gather plus the logsumexp's
    softmax and adds them (about 1.7x the time on a 4k x 2k bf16 block).
    """

    @staticmethod
    def forward(ctx, flat: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool):
        n = flat.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=flat.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=flat.device)
        rows = _row_chunks(flat)
        for s in range(0, n, rows):
            x = flat[s : s + rows]  # [n, V]
            if temperature != 1.0:
                x = x.float() / temperature
            idx = labels[s : s + rows, None]  # [n, 1]
            ls = torch.log_softmax(x, dim=-1, dtype=torch.float32)  # [n, V], upcast inside the kernel
            picked = ls.gather(-1, idx).squeeze(-1)
            logp[s : s + rows] = picked
            lse[s : s + rows] = x.gather(-1, idx).squeeze(-1).float() - picked
            if with_entropy:
                # -sum(p log p); an underflowed p is 0 and its log-softmax finite, so 0, not NaN.
                entropy[s : s + rows] = -ls.exp().mul_(ls).sum(-1)
        ctx.save_for_backward(flat, labels, lse)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, _grad_entropy: torch.Tensor):
        flat, labels, lse = ctx.saved_tensors
        t = ctx.temperature
        grad = torch.empty_like(flat)
        rows = _row_chunks(flat)
        for s in range(0, flat.shape[0], rows):
            g = grad_logp[s : s + rows, None]  # [n, 1]
            x = flat[s : s + rows].to(torch.float32, copy=True)  # [n, V], never a view of the input
            if t != 1.0:
                x.div_(t)
            # exp(x - lse) in place measured ~1.4x faster than a fresh float32 softmax of the chunk.
            x.sub_(lse[s : s + rows, None]).exp_().mul_(-g)  # -softmax * g
            x.scatter_add_(-1, labels[s : s + rows, None], g)  # + onehot * g
            if t != 1.0:
                x.div_(t)
            grad[s : s + rows] = x
        return grad, None, None, None


def token_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(log softmax(logits / T)[label], entropy of softmax(logits / T) or None) -> float32 [...] each.

    logits [..., V] in any float dtype (upcast to float32 one row chunk at a
    time, so the full [..., V] float32 log-softmax never exists), labels [...].
    The log-probs carry a gradient; the entropy does not (it is for metrics:
    an entropy bonus needs ``entropy_from_logits``).
    """
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)  # [N, V]
    logp, entropy = _TokenLogProbs.apply(flat, labels.reshape(-1), float(temperature), with_entropy)
    shape = labels.shape
    return logp.reshape(shape), (entropy.reshape(shape) if with_entropy else None)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label] for logits [..., V] and labels [...] -> float32 [...]."""
    return token_logprobs(logits, labels)[0]


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) for logits [..., V] -> float32 [...].

    ``logsumexp(l) - sum(softmax(l) * l)`` equals ``-sum(p log p)`` but never
    takes the log of an underflowed probability, so it stays finite for very
    peaked distributions. Row-chunked like ``logprobs_from_logits``.
    """
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)  # [N, V]
    rows = _row_chunks(flat)
    out = []
    for start in range(0, flat.shape[0], rows):
        chunk = flat[start : start + rows].float()  # [n, V]
        probs = torch.softmax(chunk, dim=-1)
        out.append(torch.logsumexp(chunk, dim=-1) - (probs * chunk).sum(-1))
    if not out:
        return flat.new_zeros(logits.shape[:-1], dtype=torch.float32)
    return torch.cat(out).reshape(logits.shape[:-1])


def token_outputs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool = False,
) -> dict[str, torch.Tensor]:
    """{"logp", optional "entropy"} [n, R] float32 from the logits [n, R, V] that predict ``labels`` [n, R].

    The entropy carries a gradient only with ``entropy_grad`` (an entropy bonus); otherwise it is a
    metric computed in the same chunked pass as the log-probs.
    """
    if with_entropy and entropy_grad:
        logits = logits.float() / temperature
        return {"logp": logprobs_from_logits(logits, labels), "entropy": entropy_from_logits(logits)}
    logp, entropy = token_logprobs(logits, labels, temperature, with_entropy)
    return {"logp": logp} if entropy is None else {"logp": logp, "entropy": entropy}
