"""GRPO through the loop with ``rollout.engine: sglang`` on 2 torchrun ranks, rollout TP 1 (one SGLang engine
per rank) and 2 (one engine of TP 2 on rank 0, its outputs broadcast to rank 1), and under split placement
(the SGLang engine on the rollout ranks, TP 1 and 2, the weights sent from the training rank): the loop's metrics, and
the rollout log-probs equal to the actor's after every weight sync.

    .venv-sglang/bin/python -m pytest tests/sglang_engine/test_sglang_loop.py
"""

from __future__ import annotations

import pytest
from engine_contract import skip_unless_installed
from engine_loop import check_grpo_through_loop

skip_unless_installed("sglang")


@pytest.mark.e2e
@pytest.mark.parametrize("tp", [1, 2])
def test_grpo_with_sglang(tp, tmp_path):
    check_grpo_through_loop("sglang", tp, tmp_path / f"tp{tp}")


@pytest.mark.e2e
@pytest.mark.parametrize("tp", [1, 2])
def test_grpo_with_sglang_on_split_placement(tp, tmp_path):
    """tp rollout ranks (one rollout TP group; at TP 2 the leader's engine) + 1 training rank."""
    check_grpo_through_loop("sglang", tp, tmp_path / f"split{tp}", split=True)
