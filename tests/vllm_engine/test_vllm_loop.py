"""GRPO through the loop with ``rollout.engine: vllm`` on 2 torchrun ranks, rollout TP 1 and 2: the loop's
metrics, and the rollout log-probs equal to the actor's after every weight sync.

    .venv-vllm/bin/python -m pytest tests/vllm_engine/test_vllm_loop.py
"""

from __future__ import annotations

import pytest
from engine_loop import check_grpo_through_loop

from spmdrl.rollout.vllm import vllm_available

# CI runs this file inside .venv-vllm (made by .ci/vllm-venv) from tests/e2e/test_engine_venvs.py;
# without vLLM it skips with the reason in pytest's summary.
if vllm_available() is not None:
    pytest.skip(f"{vllm_available()}; tests/e2e/test_engine_venvs.py runs this in .venv-vllm",
                allow_module_level=True)


@pytest.mark.e2e
@pytest.mark.parametrize("tp", [1, 2])
def test_grpo_with_vllm(tp, tmp_path):
    check_grpo_through_loop("vllm", tp, tmp_path / f"tp{tp}")
