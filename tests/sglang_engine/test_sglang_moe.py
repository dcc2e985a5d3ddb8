"""SGLang samples a Mixture-of-Experts model (``builtin:tiny-moe``, Qwen3-MoE) from the trainer's weights: the
FSDP2 export names a layer's experts as transformers holds them in memory (fused ``[experts, ...]``
tensors), the engine splits them into the one-tensor-an-expert names SGLang's Qwen3-MoE loader takes
(``checkpoint.hf_folder.per_expert``), and SGLang then scores what it samples as the native engine does.

    .venv-sglang/bin/python -m pytest tests/sglang_engine/test_sglang_moe.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_contract import ATOL, EOS, PAD, _prompts, skip_unless_installed

from spmdrl.rollout import build_rollout
from spmdrl.rollout.base import SamplingParams

skip_unless_installed("sglang")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    from spmdrl.builtin.models import build_model

    return build_model(tmp_path_factory.mktemp("moe") / "tiny-moe", "tiny-moe", seed=0)


def test_moe_weights_from_the_trainer_sample_as_the_native_engine(moe_dir):
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).state_dict()
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in trained)  # the trainer's layout
    native = build_rollout("native", str(moe_dir), eos_token_ids=[EOS], pad_token_id=PAD)
    eng = build_rollout("sglang", str(moe_dir), eos_token_ids=[EOS], pad_token_id=PAD, max_num_seqs=8,
                        max_model_len=64, seed=0, dtype="float32")
    try:
        eng.update_weights(trained.items())
        prompts, greedy = _prompts([4, 7, 3], seed=3), SamplingParams(n=1, max_tokens=8, temperature=0.0)
        mine, theirs = eng.generate(prompts, greedy), native.generate(prompts, greedy)
    finally:
        eng.close()
    assert torch.equal(mine.response_ids, theirs.response_ids)
    torch.testing.assert_close(mine.logprobs, theirs.logprobs, atol=ATOL, rtol=0)
