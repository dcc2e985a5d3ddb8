"""What the tests of every library rollout engine share (tests/vllm_engine, tests/sglang_engine): prompts, the
native engine and the checkpoint's weights as fixtures, transformers' log-probs under the sampling
distribution, and the contract tests each engine must pass. An engine's test module defines its ``engine``
fixture and imports the tests it runs (pytest collects them there)."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

import pytest
import torch

from spmdrl.rollout import build_rollout
from spmdrl.rollout.base import SamplingParams
from spmdrl.rollout.sampling import truncate_logits

EOS, PAD = 2, 0
# fp32 on both sides; the libraries' CPU GEMMs and attention round differently from torch's.
ATOL = 1e-4


def skip_unless_installed(engine: str) -> None:
    """Skip the calling test module unless ``engine``'s library is installed here. CI runs each library's
    tests inside its own venv (.ci/vllm-venv, .ci/sglang-venv) from tests/e2e/test_engine_venvs.py; without
    the library the module skips with the reason in pytest's summary, never silently."""
    why = getattr(importlib.import_module(f"spmdrl.rollout.{engine}"), f"{engine}_available")()
    if why is not None:
        pytest.skip(f"{why}; tests/e2e/test_engine_venvs.py runs this in .venv-{engine}",
                    allow_module_level=True)


def _prompts(lengths: list[int], seed: int = 0, vocab: int = 2048) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def native(tiny_model_dir: Path):
    return build_rollout("native", str(tiny_model_dir), eos_token_ids=[EOS], pad_token_id=PAD)


@pytest.fixture(scope="module")
def weights(tiny_model_dir: Path) -> dict[str, torch.Tensor]:
    from spmdrl.rollout.native.model import Decoder

    return dict(Decoder.iter_checkpoint(str(tiny_model_dir)))


def _hf_logprobs(model, out, temperature: float, top_k: int = -1, top_p: float = 1.0,
                 truncate=truncate_logits) -> torch.Tensor:
    """transformers' log-probs of the responses under the sampling distribution. -> [N, R]"""
    full = torch.cat([out.prompt_ids, out.response_ids], 1)
    mask = torch.cat([out.prompt_mask, out.response_mask], 1)
    with torch.inference_mode():
        logits = model(input_ids=full, attention_mask=mask.long(),
                       position_ids=(mask.long().cumsum(-1) - 1).clamp(min=0)).logits
    P = out.prompt_ids.shape[1]
    scaled = logits[:, P - 1:-1].float() / temperature  # [N, R, V]
    N, R, V = scaled.shape
    lp = torch.log_softmax(truncate(scaled.reshape(N * R, V), top_k, top_p).view(N, R, V), -1)
    return torch.where(out.response_mask, lp.gather(-1, out.response_ids[..., None]).squeeze(-1), 0.0)


def _hf_with(path: Path, state: dict[str, torch.Tensor]):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return model


def test_greedy_matches_native_engine(engine, native):
    # Stop ids spread over the vocabulary make rows end at different steps.
    prompts = _prompts([3, 10, 6, 1], seed=9)
    sp = SamplingParams(n=1, max_tokens=16, temperature=0.0, stop_token_ids=list(range(3, 2048, 7)))
    a, b = engine.generate(prompts, sp), native.generate(prompts, sp)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_mask, b.response_mask)
    assert a.finish_reasons == b.finish_reasons and "stop" in a.finish_reasons
    assert torch.equal(a.prompt_ids, b.prompt_ids) and torch.equal(a.prompt_mask, b.prompt_mask)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=ATOL, rtol=0)
    # rollout.calculate_log_probs false: the same rows, and the library engine skips the log-probs.
    c = engine.generate(prompts, dataclasses.replace(sp, logprobs=False))
    assert torch.equal(c.response_ids, a.response_ids) and c.logprobs is None


def test_output_contract(engine):
    prompts = _prompts([4, 7], seed=1)
    sp = SamplingParams(n=3, max_tokens=12, temperature=1.0, stop_token_ids=list(range(3, 2048, 11)))
    out = engine.generate(prompts, sp)
    assert out.prompt_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert out.response_ids.shape == out.response_mask.shape == out.logprobs.shape == (6, 12)
    stops = torch.tensor(list(range(3, 2048, 11)))
    for i in range(6):
        n = int(out.response_lengths[i])
        resp = out.response_ids[i]
        assert ((resp[n:] == PAD).all() and (out.logprobs[i, n:] == 0).all()
                and (out.logprobs[i, :n] < 0).all())
        ended = bool(torch.isin(resp[n - 1], stops))
        assert out.finish_reasons[i] == ("stop" if ended else "length") and (ended or n == 12)
    # The n samples of a prompt are drawn independently; greedy n > 1 gives n identical rows.
    assert not torch.equal(out.response_ids[0], out.response_ids[1])
    g = engine.generate(prompts, SamplingParams(n=2, max_tokens=6, temperature=0.0))
    assert torch.equal(g.response_ids[0], g.response_ids[1]) and len(g) == 4
