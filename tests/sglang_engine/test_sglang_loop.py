"""GRPO through the loop with ``rollout.engine: sglang`` on 2 torchrun ranks, rollout TP 1 (one SGLang engine
per rank) and 2 (one engine of TP 2 on rank 0, its outputs broadcast to rank 1), and under split placement
(the SGLang engine on 2 rollout ranks at TP 2, the weights sent from the training rank): the loop's
metrics, and the rollout log-probs equal to the actor's after every weight sync.

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
def test_grpo_with_sglang_on_split_placement(tmp_path):
    """2 rollout ranks (one rollout TP group: the leader's engine, its outputs broadcast, the weights pushed
    by the leader alone) + 1 training rank. What TP 1 adds is the colocated TP 1 engine's."""
    check_grpo_through_loop("sglang", 2, tmp_path / "split", split=True)
