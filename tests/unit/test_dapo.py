"""DAPO overlong penalty and group filtering against hand-computed values."""

import pytest
import torch

from spmdrl.algos.dapo import filter_groups, overlong_penalty

T = torch.tensor


def test_overlong_penalty_is_linear_over_the_buffer():
    lengths = T([3, 6, 7, 8, 10, 12])
    # max 10, buffer 4: free up to 6 tokens, then -1/4 per token, -1 at 10 (and no lower past it)
    out = overlong_penalty(lengths, max_response_length=10, buffer_len=4, penalty_factor=1.0)
    torch.testing.assert_close(out, T([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    out = overlong_penalty(lengths, max_response_length=10, buffer_len=4, penalty_factor=2.0)
    torch.testing.assert_close(out, T([0.0, 0.0, -0.5, -1.0, -2.0, -2.0]))


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
