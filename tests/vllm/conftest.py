"""Tests of the vLLM rollout engine. They need vLLM importable: CI runs them inside ``.venv-vllm``
(made by ``.ci/vllm-venv``) from tests/e2e/test_vllm_venv.py; in an environment without vLLM they skip
with that reason (shown by ``-ra``)."""

from __future__ import annotations

import pytest

from spmdrl.rollout.vllm import vllm_available

_why = vllm_available()
if _why is not None:
    pytest.skip(f"{_why}; tests/e2e/test_vllm_venv.py runs these in .venv-vllm", allow_module_level=True)
