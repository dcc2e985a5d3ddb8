"""GRPO through the loop with ``rollout.engine: vllm`` on 2 torchrun ranks, rollout TP 1 and 2: the loop's
metrics, and the rollout log-probs equal to the actor's after every weight sync.

    .venv-vllm/bin/python -m pytest tests/vllm_engine/test_vllm_loop.py
"""

from __future__ import annotations

import pytest
from engine_contract import skip_unless_installed
from engine_loop import check_grpo_through_loop

skip_unless_installed("vllm")


@pytest.mark.e2e
@pytest.mark.parametrize("tp", [1, 2])
def test_grpo_with_vllm(tp, tmp_path):
    check_grpo_through_loop("vllm", tp, tmp_path / f"tp{tp}")
