"""The training batch: named tensors that share a leading sample dimension.

One ``Batch`` holds this rank's share of a step's responses. Keys used by the
loop (N = responses on this rank, P = prompt length, R = response length):

    input_ids       [N, P+R] int64   prompt (left-padded) + response (right-padded)
    attention_mask  [N, P+R] int64
    position_ids    [N, P+R] int64
    response_mask   [N, R]   float32 1 on generated tokens
    index           [N]      int64   global prompt id: the n responses of a prompt share it
    scores          [N]      float32 sequence reward
    token_rewards   [N, R]   float32 reward placed on the last response token (minus KL penalty)
    old_logp, ref_logp, values, advantages, returns   [N, R] float32
    routed_experts  [N, P+R, L, k] ``route_dtype``   an MoE model's experts of each token in each of its L
                    layers, as the rollout (R3) or the old-log-prob pass (R2) routed it; ``unrouted`` where
                    nothing routed the token (the trainer's router then chooses)

Lists of Python objects (``non_tensor``) ride along with the same leading size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch

if TYPE_CHECKING:
    from spmdrl.rollout.base import GenerationOutput


# The ``routed_experts`` value of a token no engine routed, by the record's dtype.
_UNROUTED = {torch.uint8: 255, torch.int32: -1}


def route_dtype(num_experts: int) -> torch.dtype:
    """The dtype of ``routed_experts``: uint8 while the expert ids and the ``unrouted`` mark fit (gloo has
    no int16), else int32."""
    return torch.uint8 if num_experts < 255 else torch.int32


def unrouted(num_experts: int) -> int:
    """The ``routed_experts`` value of a token no engine routed."""
    return _UNROUTED[route_dtype(num_experts)]


def unrouted_in(record: torch.Tensor) -> int:
    """The "no engine routed it" value of a ``routed_experts`` record (by its dtype)."""
    return _UNROUTED[record.dtype]


class Batch:
    def __init__(self, tensors: dict[str, torch.Tensor] | None = None,
                 non_tensor: dict[str, list] | None = None):
        self.tensors: dict[str, torch.Tensor] = dict(tensors or {})
        self.non_tensor: dict[str, list] = dict(non_tensor or {})
        self._check()

    def _check(self) -> None:
        sizes = {k: v.shape[0] for k, v in self.tensors.items()}
        sizes.update({k: len(v) for k, v in self.non_tensor.items()})
        if len(set(sizes.values())) > 1:
            raise ValueError(f"batch fields disagree on the leading size: {sizes}")

    def __len__(self) -> int:
        for v in self.tensors.values():
            return v.shape[0]
        for v in self.non_tensor.values():
            return len(v)
        return 0

    def __getitem__(self, key: str) -> Any:
        if key in self.tensors:
            return self.tensors[key]
        return self.non_tensor[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            self.tensors[key] = value
        else:
            self.non_tensor[key] = list(value)
        self._check()

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.non_tensor

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def keys(self) -> list[str]:
        return list(self.tensors) + list(self.non_tensor)

    def select(self, idx: torch.Tensor | Sequence[int] | slice) -> "Batch":
        """Rows ``idx`` of every field (a slice keeps views; an index tensor copies)."""
        if isinstance(idx, slice):
            return Batch(
                {k: v[idx] for k, v in self.tensors.items()}, {k: v[idx] for k, v in self.non_tensor.items()}
            )
        idx_t = torch.as_tensor(idx, dtype=torch.long)
        rows = idx_t.tolist()
        return Batch(
            {k: v.index_select(0, idx_t.to(v.device)) for k, v in self.tensors.items()},
            {k: [v[i] for i in rows] for k, v in self.non_tensor.items()},
        )

    def split(self, size: int) -> Iterator["Batch"]:
        """Consecutive chunks of ``size`` rows (the last may be shorter)."""
        for start in range(0, len(self), size):
            yield self.select(slice(start, start + size))

    def to(self, device: torch.device | str) -> "Batch":
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, self.non_tensor)

    @property
    def widths(self) -> tuple[int, int]:
        """(P, R): the prompt and response widths of the sequence fields."""
        resp = self.tensors["response_mask"].shape[1]
        return self.tensors["input_ids"].shape[1] - resp, resp

    def padded(self, prompt_len: int, response_len: int) -> "Batch":
        """The same rows with prompts left-padded to ``prompt_len`` and responses right-padded to
        ``response_len`` columns of zeros (attention 0, mask 0), in every [N, P+R] and [N, R] field; other
        fields as they are."""
        P, R = self.widths
        if (P, R) == (prompt_len, response_len):
            return self
        if prompt_len < P or response_len < R:
            raise ValueError(f"cannot pad a batch of widths {(P, R)} to the narrower "
                             f"{(prompt_len, response_len)}")
        out = {}
        for key, v in self.tensors.items():
            if v.dim() >= 2 and v.shape[1] == P + R:  # [N, P+R]: zeros on the left of the prompt too
                v = torch.cat([v.new_zeros(v.shape[0], prompt_len - P, *v.shape[2:]), v,
                               v.new_zeros(v.shape[0], response_len - R, *v.shape[2:])], dim=1)
            elif v.dim() >= 2 and v.shape[1] == R:  # [N, R]
                v = torch.cat([v, v.new_zeros(v.shape[0], response_len - R, *v.shape[2:])], dim=1)
            out[key] = v
        return Batch(out, self.non_tensor)

    @staticmethod
    def cat(batches: Sequence["Batch"]) -> "Batch":
        """Rows of ``batches`` in order. Batches from different generation calls (DAPO's rounds) have their
        own prompt and response widths: each is padded to the widest first."""
        first = batches[0]
        if "response_mask" in first.tensors and "input_ids" in first.tensors:
            widths = [b.widths for b in batches]
            p, r = max(w[0] for w in widths), max(w[1] for w in widths)
            batches = [b.padded(p, r) for b in batches]
        return Batch(
            {k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors},
            {k: [x for b in batches for x in b.non_tensor[k]] for k in first.non_tensor},
        )


def from_generation(gen: "GenerationOutput", prompt_index: torch.Tensor) -> Batch:
    """Training rows from one ``generate`` call.

    ``prompt_index`` [num_prompts] holds the global id of each input prompt;
    row i of ``gen`` came from input prompt ``gen.prompt_index[i]``.
    """
    prompt_mask = gen.prompt_mask.long()  # [N, P]
    response_mask = gen.response_mask.long()  # [N, R]
    # Tool output inside a multi-turn response is attended to (attention 1) but not trained on (mask 0).
    response_attention = response_mask if gen.response_attention is None else gen.response_attention.long()
    attention_mask = torch.cat([prompt_mask, response_attention], dim=1)  # [N, P+R]
    # Left padding: positions count real tokens only, as the rollout engine saw them.
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # [N, P+R]
    tensors = {
        "input_ids": torch.cat([gen.prompt_ids, gen.response_ids], dim=1),  # [N, P+R]
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": response_mask.float(),  # [N, R]
        "index": prompt_index[gen.prompt_index],  # [N]
    }
    if gen.routed_experts is not None:
        tensors["routed_experts"] = gen.routed_experts  # [N, P+R, L, k]
    return Batch(tensors)


def add_scores(batch: "Batch", scores: torch.Tensor) -> None:
    """``scores`` [N] added to the rows' ``scores`` (they become them where the batch has none yet: its first
    source), and the sum placed as ``token_rewards`` [N, R] (one place for every scorer of a batch: the
    rollout's sources, then under split placement the training ranks' reward model)."""
    if "scores" in batch:
        scores = batch["scores"] + scores.to(batch["scores"].device)
    batch["scores"] = scores
    batch["token_rewards"] = place_scores(scores, batch["response_mask"])


def place_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Token rewards [N, R]: each sequence score [N] on its last generated token (the mask may have interior
    zeros: tool output inside a multi-turn response)."""
    positions = torch.arange(response_mask.shape[1], device=response_mask.device)  # [R]
    last = torch.where(response_mask.bool(), positions, -1).max(-1).values  # [N]; -1 for an empty row
    token_rewards = torch.zeros_like(response_mask, dtype=torch.float32)
    rows = torch.arange(len(scores))
    token_rewards[rows, last.clamp(min=0)] = scores.float() * (last >= 0)
    return token_rewards
