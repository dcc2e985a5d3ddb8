"""Model-based reward: how its score combines with the rule score, and the chat rendering it scores."""

from __future__ import annotations

import pytest
import torch

from spmdrl.reward.model import check_weights, render
from spmdrl.reward.sources import combine


def test_combine_scores_weights_and_verl_default() -> None:
    rm, rule = torch.tensor([0.5, -1.0]), torch.tensor([1.0, 0.0])
    # The sources in build_rewards' order: rule (weight reward_model.rule_weight), then the reward model.
    assert combine([(0.5, rule), (1.0, rm)]).tolist() == [1.0, -1.0]
    assert combine([(0.0, rule), (2.0, rm)]).tolist() == [1.0, -2.0]  # rule ignored
    assert combine([(1.0, rm)]).tolist() == [0.5, -1.0]  # verl: rm replaces (the rule source is left out)
    assert combine([(1.0, rule), (0.0, rm)]).tolist() == [1.0, 0.0]


def test_check_weights_one_sentence() -> None:
    with pytest.raises(ValueError, match="both 0"):
        check_weights(0.0, 0.0)
    with pytest.raises(ValueError, match="reward_model.rule_weight is nan"):
        check_weights(1.0, float("nan"))
    check_weights(0.0, 1.0)


def test_render_appends_the_response_as_the_assistant_turn(tmp_path) -> None:
    from spmdrl.builtin.models import build_tokenizer

    tok = build_tokenizer(tmp_path, seed=0)
    chats = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Copy: ab"}]]
    assert render(tok, chats, ["ab"]) == [
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCopy: ab<|im_end|>\n"
        "<|im_start|>assistant\nab<|im_end|>\n"
    ]


def test_config_check_refuses_a_causal_lm_as_reward_model(tmp_path) -> None:
    from spmdrl.builtin.models import build_model
    from spmdrl.config.checks import validate_config
    from spmdrl.config.parse import parse_config
    from spmdrl.errors import ConfigError

    policy = build_model(tmp_path / "policy", "tiny", seed=0)
    rm = build_model(tmp_path / "rm", "tiny", seed=0, reward=True)
    cfg, _ = parse_config(["--reward_model.enable", "true", "--reward_model.model.path", str(policy)])
    with pytest.raises(ConfigError, match="holds Qwen2ForCausalLM; the reward model must be a "
                                          r"\*ForSequenceClassification model"):
        validate_config(cfg, 1)
    cfg, _ = parse_config(["--reward_model.enable", "true", "--reward_model.model.path", str(rm)])
    validate_config(cfg, 1)


def test_a_multi_turn_response_is_scored_as_its_conversation(tiny_model_dir, tmp_path, gloo_world_of_one):
    """In a multi-turn run the reward model reads the whole conversation after the prompt (assistant turns
    and tool output, extra_info["messages"]), rendered with its own template, not one decoded message."""
    from rows import fsdp2_engine
    from transformers import AutoTokenizer

    from spmdrl.batch import Batch
    from spmdrl.builtin.models import build_model
    from spmdrl.reward.model import RewardModelScorer
    from spmdrl.reward.sources import ModelReward

    rm_dir = build_model(tmp_path / "rm", "tiny", seed=0, reward=True)
    tok = AutoTokenizer.from_pretrained(rm_dir)
    scorer = RewardModelScorer(fsdp2_engine(rm_dir, "reward"), tok, group=torch.distributed.group.WORLD,
                               micro_batch_size=4, max_length=None)
    chat = [{"role": "user", "content": "What is 12 * 34?"}]
    turns = [{"role": "assistant", "content": '<tool_call>{"name": "calculator"}</tool_call>'},
             {"role": "tool", "content": "408"}, {"role": "assistant", "content": "Answer: 408"}]
    flat = '<tool_call>{"name": "calculator"}</tool_call>\n408\nAnswer: 408'  # the decoded response
    assert render(tok, [chat], [flat], [turns]) == [tok.apply_chat_template([*chat, *turns], tokenize=False)]
    batch = Batch({"response_mask": torch.ones(2, 3)},
                  {"chat": [chat, chat], "extra_info": [{"messages": turns}, {"index": 1}]})
    got = ModelReward(scorer, 1.0)(batch, [flat, "Answer: 408"]).scores
    want = scorer.model_scores([chat, chat], [flat, "Answer: 408"], [turns, None])
    single = scorer.model_scores([chat], [flat])
    assert torch.equal(got, want) and float((got[0] - single[0]).abs()) > 1e-6
