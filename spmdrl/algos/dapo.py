"""DAPO's reward shaping and dynamic sampling, as pure functions.

- ``overlong_penalty``: a soft penalty for responses that run into the length
  limit (``reward.overlong_buffer``), added to the score so truncated answers
  are discouraged gradually instead of being rewarded or punished at random.
- ``filter_groups``: dynamic sampling (``algorithm.filter_groups``): a group
  whose responses all got the same score has zero advantage under any group
  baseline, so it only dilutes the batch; the loop drops it and generates more.
"""

from __future__ import annotations

import torch


def overlong_penalty(
    response_lengths: torch.Tensor,  # [B]
    *,
    max_response_length: int,
    buffer_len: int,
    penalty_factor: float,
) -> torch.Tensor:
    """0 up to ``max_response_length - buffer_len`` tokens, then linear down to ``-penalty_factor``
    at ``max_response_length``.

    Returns float32 [B]. Lengths past ``max_response_length`` (possible when it is verl's ``max_resp_len``,
    set below the generation limit) go on down the same line, as verl's DAPO reward manager has them.
    """
    if not 0 < buffer_len <= max_response_length:
        raise ValueError(
            f"reward.overlong_buffer.len must be in (0, max_response_length={max_response_length}], "
            f"got {buffer_len}"
        )
    expected = max_response_length - buffer_len
    exceed = response_lengths.to(torch.float32) - expected  # [B]
    return (-exceed / buffer_len * penalty_factor).clamp(max=0.0)


def filter_groups(scores: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, dict[str, int]]:
    """Keep mask [B] bool dropping every group (same ``index``) whose scores are all equal.

    A group of one response is kept, as in verl: with n=1 every group would
    otherwise be dropped and dynamic sampling would never fill a batch.
    Returns ``(keep, {"kept_groups": ..., "dropped_groups": ...})``.
    """
    _, gid = torch.unique(index, return_inverse=True)  # [B]
    num_groups = int(gid.max().item()) + 1 if gid.numel() else 0
    s = scores.to(torch.float64)
    lo = s.new_full((num_groups,), float("inf")).scatter_reduce(0, gid, s, "amin")  # [G]
    hi = s.new_full((num_groups,), float("-inf")).scatter_reduce(0, gid, s, "amax")  # [G]
    size = torch.zeros_like(hi, dtype=torch.long).index_add_(0, gid, torch.ones_like(gid))  # [G]
    keep_group = (hi > lo) | (size == 1)  # [G]
    kept = int(keep_group.sum().item())
    return keep_group[gid], {"kept_groups": kept, "dropped_groups": num_groups - kept}
