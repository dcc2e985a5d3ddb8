"""vLLM and a Mixture-of-Experts model (``builtin:tiny-moe``, Qwen3-MoE) on CPU: vLLM's own Qwen3-MoE class
loads the folder's one-tensor-an-expert checkpoint and samples as the native engine does, but an in-place
reload of those same weights (every weight sync of a run) leaves its MoE layers wrong. So ``check_config``
refuses an MoE model for vLLM on CPU with one sentence; when a vLLM release reloads them right, the second
test fails and the refusal can go.

    .venv-vllm/bin/python -m pytest tests/vllm_engine/test_vllm_moe.py
"""

from __future__ import annotations

import pytest
import torch
from engine_contract import ATOL, EOS, PAD, _prompts, skip_unless_installed

from spmdrl.rollout import build_rollout
from spmdrl.rollout.base import SamplingParams

skip_unless_installed("vllm")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    import torch.distributed as dist

    from spmdrl.builtin.models import build_model
    from spmdrl.parallel import init_distributed

    moe = build_model(tmp_path_factory.mktemp("moe") / "tiny-moe", "tiny-moe", seed=0)
    prompts, greedy = _prompts([4, 7, 3], seed=3), SamplingParams(n=1, max_tokens=8, temperature=0.0)
    native = build_rollout("native", str(moe), eos_token_ids=[EOS], pad_token_id=PAD)
    init_distributed("cpu")
    eng = build_rollout("vllm", str(moe), eos_token_ids=[EOS], pad_token_id=PAD, max_num_seqs=8,
                        max_model_len=64, seed=0, dtype="float32")
    try:
        loaded = eng.generate(prompts, greedy)
        from transformers import AutoModelForCausalLM

        same = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32).state_dict()
        eng.update_weights(same.items())
        reloaded = eng.generate(prompts, greedy)
    finally:
        eng.close()
    assert not dist.is_initialized()
    return {"native": native.generate(prompts, greedy), "loaded": loaded, "reloaded": reloaded, "path": moe}


def test_vllm_loads_the_moe_checkpoint_as_the_native_engine(runs):
    assert torch.equal(runs["loaded"].response_ids, runs["native"].response_ids)
    torch.testing.assert_close(runs["loaded"].logprobs, runs["native"].logprobs, atol=ATOL, rtol=0)


def test_vllm_on_cpu_reloads_moe_weights_wrong_and_the_config_refuses_it(runs):
    from spmdrl.config import Config
    from spmdrl.rollout.vllm import VLLMRollout

    gap = float((runs["reloaded"].logprobs - runs["native"].logprobs).abs().max())
    assert gap > 1e-2, f"vLLM now reloads MoE weights in place (gap {gap}): lift the refusal in check_config"
    cfg = Config()
    cfg.model.path, cfg.rollout.engine, cfg.trainer.device = str(runs["path"]), "vllm", "cpu"
    with pytest.raises(ValueError, match="is a Mixture-of-Experts model, which vLLM .* does not reload"):
        VLLMRollout.check_config(cfg)
