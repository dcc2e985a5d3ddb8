"""The SGLang engine against the native engine and transformers on the same weights: generation contract,
log-prob convention, in-place weight sync (bucketed, tied head), sleep/wake on CPU, multi-turn tool calls,
and a shutdown that stops the engine's children only.

One ``sglang.Engine`` for the module (its start takes 10-47 s on 2 cores).

    .venv-sglang/bin/python -m pytest tests/sglang_engine/test_sglang_engine.py
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import psutil
import pytest
import torch
from engine_contract import (  # noqa: F401 (its tests are collected here)
    ATOL,
    EOS,
    PAD,
    _hf_logprobs,
    _hf_with,
    _prompts,
    skip_unless_installed,
    test_greedy_matches_native_engine,
    test_output_contract,
)

from spmdrl.rollout import build_rollout
from spmdrl.rollout.base import SamplingParams
from spmdrl.rollout.sampling import truncate_logits

skip_unless_installed("sglang")


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path):
    bystander = subprocess.Popen(["sleep", "600"])  # another child of this process, as a tool worker is
    eng = build_rollout("sglang", str(tiny_model_dir), eos_token_ids=[EOS], pad_token_id=PAD,
                        max_num_seqs=32, max_model_len=128, seed=0)
    children = eng.engine.get_all_child_pids()
    try:
        yield eng
    finally:
        eng.close()
        alive = bystander.poll() is None
        bystander.kill()
        bystander.wait()
    # close stops the scheduler and detokenizer, and nothing else of this process (SGLang's shutdown would)
    assert alive and children and not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                                          for p in children)


def _joint_truncate(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """SGLang's filter: the top-k tokens whose preceding mass in the full distribution is within top_p
    (transformers and vLLM apply top-p to the renormalised top-k instead). logits [M, V] -> [M, V]"""
    probs, idx = torch.softmax(logits, -1).sort(-1, descending=True)
    keep = ((torch.arange(logits.shape[-1]) < top_k)[None, :]
            & ((probs.cumsum(-1) - probs) <= top_p))  # [M, V] in sorted order
    kept = logits.gather(-1, idx).where(keep, -torch.inf)  # [M, V] sorted
    return torch.full_like(logits, -torch.inf).scatter(-1, idx, kept)


def test_ignore_eos(engine):
    prompts = _prompts([5, 8], seed=2)
    # EOS as every token's fate would not stop: ignore_eos generates max_tokens for every row.
    out = engine.generate(prompts, SamplingParams(n=2, max_tokens=7, temperature=1.0, ignore_eos=True))
    assert out.finish_reasons == ["length"] * 4 and bool(out.response_mask.all())
    # SGLang's ignore_eos also ignores stop ids, so the engine refuses the pair rather than run past them.
    with pytest.raises(ValueError, match="ignore_eos with stop_token_ids"):
        engine.generate(prompts, SamplingParams(n=1, max_tokens=5, stop_token_ids=[7], ignore_eos=True))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, -1, 1.0), (0.7, 20, 1.0),
                                                     (0.7, 20, 0.9)])
def test_logprobs_follow_the_sampling_distribution(engine, tiny_model_dir, temperature, top_k, top_p):
    """The engine's log-probs equal transformers' log-softmax of the truncated, tempered logits: the
    convention of spmdrl.rollout.sampling (SGLang's own are not renormalised after top-k / top-p); with
    top-k and top-p both on, under SGLang's joint filter, which the tokens were drawn with."""
    hf = _hf_with(tiny_model_dir, {})
    out = engine.generate(_prompts([6, 3], seed=4),
                          SamplingParams(n=4, max_tokens=12, temperature=temperature, top_k=top_k,
                                         top_p=top_p))
    truncate = _joint_truncate if top_p < 1.0 else truncate_logits
    torch.testing.assert_close(out.logprobs, _hf_logprobs(hf, out, temperature, top_k, top_p, truncate),
                               atol=ATOL, rtol=0)
    if top_p < 1.0:  # the joint filter is not transformers' sequential one on this model
        assert (out.logprobs - _hf_logprobs(hf, out, temperature, top_k, top_p)).abs().max() > 100 * ATOL


def test_top_p_without_top_k_is_refused(engine):
    from spmdrl.config import Config
    from spmdrl.rollout.sglang import SGLangRollout

    with pytest.raises(ValueError, match="SamplingParams.top_p is 0.9 with SamplingParams.top_k -1"):
        engine.generate(_prompts([3]), SamplingParams(n=1, max_tokens=4, top_p=0.9))
    cfg = Config()
    cfg.rollout.engine, cfg.rollout.val_kwargs.do_sample, cfg.rollout.val_kwargs.top_p = "sglang", True, 0.8
    with pytest.raises(ValueError, match="rollout.val_kwargs.top_p is 0.8 with rollout.val_kwargs.top_k -1"):
        SGLangRollout.check_config(cfg)


def test_update_weights_in_place(engine, tiny_model_dir, weights):
    """New weights (embedding included: the head is tied) change the log-probs to transformers' under the
    new weights; loading the originals back restores the first greedy outputs exactly."""
    prompts = _prompts([5, 9], seed=3)
    greedy = SamplingParams(n=1, max_tokens=10, temperature=0.0)
    before = engine.generate(prompts, greedy)
    g = torch.Generator().manual_seed(0)
    new = {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in weights.items()}
    engine.options.bucket_bytes = 1 << 16  # many buckets
    engine.update_weights(iter(new.items()))
    after = engine.generate(prompts, SamplingParams(n=2, max_tokens=10, temperature=1.0))
    hf_new = _hf_with(tiny_model_dir, new)
    torch.testing.assert_close(after.logprobs, _hf_logprobs(hf_new, after, 1.0), atol=ATOL, rtol=0)
    stale = _hf_logprobs(_hf_with(tiny_model_dir, {}), after, 1.0)
    assert (after.logprobs - stale).abs().max() > 100 * ATOL  # before the sync they differ
    assert engine.last_sync["bytes"] == sum(v.numel() * 4 for v in new.values())
    engine.update_weights(iter(weights.items()))
    again = engine.generate(prompts, greedy)
    assert torch.equal(again.response_ids, before.response_ids)
    torch.testing.assert_close(again.logprobs, before.logprobs, atol=1e-6, rtol=0)


def test_sleep_and_wake_on_cpu_keep_weights(engine, weights):
    """SGLang has no memory saver on CPU: sleep/wake are no-ops, the session order still works, even
    level 2."""
    from spmdrl.rollout.session import RolloutSession

    prompts = _prompts([4], seed=8)
    greedy = SamplingParams(n=1, max_tokens=8, temperature=0.0)
    first = engine.generate(prompts, greedy)
    exports = []

    def export():
        exports.append(1)
        return iter(weights.items())

    session = RolloutSession(engine, export, sleep_level=2, sleeps=True)
    with session.awake():
        assert torch.equal(session.generate(prompts, greedy).response_ids, first.response_ids)
    with session.awake():  # level 2 counts as freed: the weights are loaded again
        assert torch.equal(session.generate(prompts, greedy).response_ids, first.response_ids)
    assert exports == [1]
    with pytest.raises(ValueError, match="tags"):
        engine.wake_up(("weights", "optimizer"))


def test_architecture_and_tp_checks(tiny_model_dir, tmp_path):
    import json
    import shutil

    from spmdrl.config import Config
    from spmdrl.rollout.sglang import SGLangRollout

    cfg = Config()
    cfg.rollout.engine = "sglang"
    cfg.model.path = str(tiny_model_dir)
    SGLangRollout.check_config(cfg)
    odd = tmp_path / "odd"
    shutil.copytree(tiny_model_dir, odd)
    c = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**c, "architectures": ["NoSuchForCausalLM"]}))
    cfg.model.path = str(odd)
    with pytest.raises(ValueError, match="NoSuchForCausalLM, which SGLang .* cannot run"):
        SGLangRollout.check_config(cfg)
    cfg.model.path = str(tiny_model_dir)  # 4 attention heads, 2 KV heads
    cfg.parallel.rollout_tp = 2
    SGLangRollout.check_config(cfg)
    cfg.parallel.rollout_tp = 3
    with pytest.raises(ValueError, match="rollout_tp is 3 but .* num_attention_heads 4, which SGLang cannot"):
        SGLangRollout.check_config(cfg)
    cfg.parallel.rollout_tp = 1
    cfg.rollout.seed_mode = "per_response"  # SGLang's seeded sampling needs GPU attention backends
    with pytest.raises(ValueError, match="seed_mode is 'per_response' with rollout.engine sglang on cpu"):
        SGLangRollout.check_config(cfg)


def test_multi_turn_tool_calls_continue_the_conversation(engine, tiny_model_dir):
    """Multi-turn generation with the calculator through this engine (the agent's one code path; SGLang's
    radix cache stands in for the native engine's kept KV cache): every turn is made to call the tool,
    and the log-probs SGLang reports for every turn equal transformers' on the final sequence, so each
    turn continued the whole conversation (tool output included) at the right positions."""
    from transformers import AutoTokenizer

    from spmdrl.agent.chat import ParsedCall
    from spmdrl.agent.rollout import ToolAgent
    from spmdrl.agent.tools import CALCULATOR_SCHEMA, ToolSpec
    from spmdrl.batch import from_generation

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    agent = ToolAgent([ToolSpec("calculator", {}, CALCULATOR_SCHEMA)], tok, [EOS], num_workers=1,
                      max_assistant_turns=3)
    agent.parse = lambda text: [ParsedCall("calculator", {"expression": "6*7"})]
    text = tok.apply_chat_template([{"role": "user", "content": "What is 48213 * 9321?"}], tokenize=False,
                                   add_generation_prompt=True)
    prompt = tok.encode(text, add_special_tokens=False)
    calls = []

    def generate(prompts, sampling):
        calls.append(len(prompts))
        return engine.generate(prompts, sampling)

    stops = list(range(3, 2048, 13))  # many stop ids end turns early, so three turns fit in the budget
    try:
        gen, trajs = agent.generate(generate, [prompt, prompt[:-5]],
                                    SamplingParams(n=2, max_tokens=64, stop_token_ids=stops))
    finally:
        agent.close()
    assert len(calls) == 3 and any(t.turns == 3 for t in trajs)
    assert (gen.response_attention & ~gen.response_mask).any()  # tool tokens inside the responses
    batch = from_generation(gen, torch.tensor([0, 1]))
    hf = _hf_with(tiny_model_dir, {})
    with torch.inference_mode():
        logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    position_ids=batch["position_ids"]).logits.float()
    R = gen.response_ids.shape[1]
    lp = torch.log_softmax(logits[:, -R - 1:-1], -1).gather(-1, gen.response_ids[..., None]).squeeze(-1)
    torch.testing.assert_close(torch.where(gen.response_mask, lp, 0.0), gen.logprobs, atol=ATOL, rtol=0)
