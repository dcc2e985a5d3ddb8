"""DAPO overlong penalty and group filtering against hand-computed values."""

import pytest
import torch

from spmdrl.algos.dapo import filter_groups, overlong_penalty

T = torch.tensor


def test_overlong_penalty_is_linear_over_the_buffer():
    lengths = T([3, 6, 7, 8, 10, 12])
    # max 10, buffer 4: free up to 6 tokens, then -1/4 per token, -1 at 10, and on past it as verl's DAPO
    # reward manager (a max_resp_len below the generation limit)
    out = overlong_penalty(lengths, max_response_length=10, buffer_len=4, penalty_factor=1.0)
    torch.testing.assert_close(out, T([0.0, 0.0, -0.25, -0.5, -1.0, -1.5]))
    out = overlong_penalty(lengths, max_response_length=10, buffer_len=4, penalty_factor=2.0)
    torch.testing.assert_close(out, T([0.0, 0.0, -0.5, -1.0, -2.0, -3.0]))


@pytest.mark.parametrize("buffer_len", [0, 11])
def test_overlong_penalty_rejects_bad_buffers(buffer_len):
    with pytest.raises(ValueError, match="overlong_buffer.len"):
        overlong_penalty(T([1]), max_response_length=10, buffer_len=buffer_len, penalty_factor=1.0)


def test_filter_groups_drops_groups_with_equal_scores():
    index = T([5, 5, 5, 9, 9, 2, 4, 4])
    scores = T([1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.5, 0.5])
    keep, counts = filter_groups(scores, index)
    # 5: mixed -> keep; 9: all 1 -> drop; 2: alone -> keep; 4: all 0.5 -> drop
    assert keep.tolist() == [True, True, True, False, False, True, False, False]
    assert counts == {"kept_groups": 2, "dropped_groups": 2}


def test_overlong_counts_the_tool_output_a_multi_turn_response_spent():
    """The length limit is spent by generated and tool tokens alike (R = data.max_response_length covers
    both), so the overlong penalty counts the attended response tokens, as verl's DAPO reward does."""
    from spmdrl.batch import Batch
    from spmdrl.reward.sources import OverlongPenalty

    gen = T([[1, 1, 0, 0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]])  # [2, R]: tool tokens 2..5
    attn = T([[1] * 10, [1, 1, 1] + [0] * 7]).long()
    batch = Batch({"response_mask": gen, "attention_mask": torch.cat([torch.ones(2, 3).long(), attn], 1)})
    out = OverlongPenalty(max_response_length=10, buffer_len=4, penalty_factor=1.0)(batch, ["", ""]).scores
    assert out.tolist() == [-1.0, 0.0]  # 10 tokens spent: the full penalty, though only 6 were generated
