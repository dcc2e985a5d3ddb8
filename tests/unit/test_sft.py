"""spmdrl.sft without processes: loss masks of both layouts, truncation, bad input sentences, batches, the
loss, verl's SFT keys and the built-in SFT data."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spmdrl.batch import Batch
from spmdrl.builtin.tasks import generate_arith, generate_arith_sft, write_parquet
from spmdrl.engines.base import LossScale
from spmdrl.errors import ConfigError
from spmdrl.objectives import sft_loss_fn
from spmdrl.sft.config import SFTConfig, SFTDataConfig, SFTMultiTurnConfig, check_sft_config, parse_sft_config
from spmdrl.sft.data import SFTDataset, collate, val_batches
from spmdrl.verl.rules import spmdrl_keys
from spmdrl.verl.sft import SFT_DEFAULTS, SFT_TABLE


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(autouse=True)
def _world_of_one(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)


def _file(tmp_path: Path, rows: list[dict], name: str = "d.parquet") -> str:
    return str(write_parquet(rows, tmp_path / name))


def _trained_text(tok, item) -> list[str]:
    """The decoded runs of consecutive trained tokens."""
    runs, current = [], []
    for token, m in zip(item.input_ids, item.loss_mask):
        if m:
            current.append(token)
        elif current:
            runs.append(tok.decode(current))
            current = []
    if current:
        runs.append(tok.decode(current))
    return runs


def test_prompt_response_masks_the_response_and_eos_only(tmp_path, tok):
    path = _file(tmp_path, [{"prompt": "What is 3 + 4?", "response": "7"}])
    item = SFTDataset([path], tok, SFTDataConfig())[0]
    text = "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n7<|im_end|>"
    assert tok.decode(item.input_ids) == text
    assert _trained_text(tok, item) == ["7<|im_end|>"]


def test_sft_prompt_tokens_are_the_rl_loaders(tmp_path, tok):
    """The warm start sees exactly the prompt tokens the RL run will give it."""
    from spmdrl.data import PromptDataset

    rl = PromptDataset(_file(tmp_path, generate_arith("train", 5, 0), "rl.parquet"), tok,
                       max_prompt_length=64)
    sft = SFTDataset([_file(tmp_path, generate_arith_sft("train", 5, 0))], tok, SFTDataConfig())
    for r, s in zip(rl.items, sft.items):
        n = len(r.prompt_ids)
        assert s.input_ids[:n] == r.prompt_ids and not any(s.loss_mask[:n]) and all(s.loss_mask[n:])


def test_builtin_sft_responses_earn_the_full_rl_reward():
    from spmdrl.reward.scorers import arith_score

    for row in generate_arith_sft("train", 50, 0):
        truth = row["reward_model"]["ground_truth"]
        assert arith_score(row["data_source"], row["response"], truth)["score"] == 1.0


def test_dict_keys_walk_into_nested_columns(tmp_path, tok):
    rows = [{"extra": {"q": {"text": "hi"}, "a": "yo"}}]
    cfg = SFTDataConfig(prompt_key="extra", response_key="extra", prompt_dict_keys=["q", "text"],
                        response_dict_keys=["a"])
    item = SFTDataset([_file(tmp_path, rows)], tok, cfg)[0]
    assert "user\nhi<|im_end|>" in tok.decode(item.input_ids)
    assert _trained_text(tok, item) == ["yo<|im_end|>"]


CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "calling the tool"},
    {"role": "tool", "content": "4"},
    {"role": "user", "content": "so?"},
    {"role": "assistant", "content": "4"},
]


def test_multiturn_trains_assistant_turns_only(tmp_path, tok):
    cfg = SFTDataConfig(multiturn=SFTMultiTurnConfig(enable=True))
    item = SFTDataset([_file(tmp_path, [{"messages": CHAT}])], tok, cfg)[0]
    assert tok.decode(item.input_ids) == tok.apply_chat_template(CHAT, tokenize=False)
    # The content and the end-of-turn token of each assistant turn; never system, user, tool or role headers.
    assert _trained_text(tok, item) == ["calling the tool<|im_end|>", "4<|im_end|>"]


@pytest.mark.parametrize("mode, kept", [("left", "end"), ("right", "start")])
def test_truncation_keeps_one_end(tmp_path, tok, mode, kept):
    path = _file(tmp_path, [{"prompt": "What is 3 + 4?", "response": "the answer is seven"}])
    full = SFTDataset([path], tok, SFTDataConfig())[0]
    item = SFTDataset([path], tok, SFTDataConfig(max_length=len(full.input_ids) - 2, truncation=mode))[0]
    expect = full.input_ids[2:] if kept == "end" else full.input_ids[:-2]
    assert item.input_ids == expect and item.loss_mask[0] == 0


def _error(tmp_path, tok, rows, **cfg) -> str:
    with pytest.raises(ConfigError) as err:
        SFTDataset([_file(tmp_path, rows)], tok, SFTDataConfig(**cfg))
    text = str(err.value)
    assert "\n" not in text
    return text


def test_bad_input_is_one_sentence_naming_file_row_and_key(tmp_path, tok):
    good = {"prompt": "q", "response": "a"}
    assert "no column 'answer'" in _error(tmp_path, tok, [good], response_key="answer")
    nested = [{"prompt": {"q": "a", "x": None}, "response": "a"},
              {"prompt": {"q": None, "x": "b"}, "response": "a"}]
    text = _error(tmp_path, tok, nested, prompt_dict_keys=["x"])
    assert "row 0" in text and "d.parquet" in text and "column 'prompt'" in text and "key 'x'" in text
    text = _error(tmp_path, tok, [good, {"prompt": "q", "response": ""}], max_length=5, truncation="right")
    assert "row 0" in text and "'response'" in text and "no response tokens" in text
    text = _error(tmp_path, tok, [good, good], max_length=5)
    assert "row 0" in text and "data.max_length=5" in text
    mt = dict(multiturn=SFTMultiTurnConfig(enable=True))
    text = _error(tmp_path, tok, [{"messages": CHAT}, {"messages": CHAT[:2]}], **mt)
    assert "row 1" in text and "'messages'" in text and "no assistant turn" in text
    no_role = [{"content": "hi"}, {"role": "assistant", "content": "x"}]
    text = _error(tmp_path, tok, [{"messages": no_role}], **mt)
    assert "row 0" in text and "message 0 has no role" in text
    # An assistant turn of tool calls only, which the tiny model's template cannot render.
    calls = [{"role": "user", "content": "hi"},
             {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}]
    text = _error(tmp_path, tok, [{"messages": calls}], **mt)
    assert "row 0" in text and "chat template cannot render it" in text


def test_collate_shifts_the_mask_onto_targets(tmp_path, tok):
    path = _file(tmp_path, [{"prompt": "a", "response": "b"}, {"prompt": "longer prompt", "response": "bb"}])
    ds = SFTDataset([path], tok, SFTDataConfig())
    batch = collate([ds[0], ds[1]], pad_id=0)
    width = max(len(ds[0].input_ids), len(ds[1].input_ids))
    assert batch["input_ids"].shape == (2, width) and batch["response_mask"].shape == (2, width - 1)
    for row, item in enumerate([ds[0], ds[1]]):
        n = len(item.input_ids)
        assert batch["response_mask"][row, : n - 1].tolist() == [float(m) for m in item.loss_mask[1:]]
        assert batch["attention_mask"][row].sum() == n and batch["response_mask"][row, n - 1:].sum() == 0


def test_val_batches_give_every_rank_the_same_rows_and_each_row_once(tmp_path, tok):
    rows = [{"prompt": str(i), "response": "x"} for i in range(5)]
    ds = SFTDataset([_file(tmp_path, rows)], tok, SFTDataConfig())
    shares = [list(val_batches(ds, 2, rank, 2)) for rank in range(2)]
    assert [len(b) for s in shares for b in s] == [2, 2, 2, 2]
    real = sorted(it.index for s in shares for b in s for it in b if any(it.loss_mask))
    assert real == [0, 1, 2, 3, 4]


def test_sft_loss_is_the_global_token_mean():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    scale = LossScale(global_tokens=6, global_seqs=4)
    loss, m = sft_loss_fn()({"logp": logp}, Batch({"response_mask": mask}), scale)
    assert loss.item() == pytest.approx((2 + 3 + 4) / 6)
    assert m == {"sft/loss": pytest.approx(9.0 / 6)}  # this micro-batch's share of the batch's mean


def test_every_sft_table_target_is_an_sft_key():
    keys = spmdrl_keys(SFTConfig)
    for rule in SFT_TABLE:
        for target in filter(None, rule.spmdrl.split(", ")):
            assert target in keys, f"{rule.verl} maps to {target}, which SFTConfig does not have"
    for key in SFT_DEFAULTS:
        assert any(r.matches(key) and not r.ignored for r in SFT_TABLE), key


def test_verl_sft_script_words_map_onto_sft_keys():
    cfg, _ = parse_sft_config([
        "data.train_files=/d/train.parquet", "data.val_files=null", "data.prompt_key=extra_info",
        "data.response_key=extra_info", "+data.prompt_dict_keys=['question']",
        "+data.response_dict_keys=[answer]",
        "data.micro_batch_size_per_gpu=8", "data.max_length=512", "data.truncation=left",
        "model.partial_pretrain=/m/qwen", "optim.lr=1e-4", "trainer.total_training_steps=50",
        "optim.warmup_steps_ratio=0.1", "trainer.default_local_dir=/out",
        "trainer.logger=['console','wandb']",
        "trainer.project_name=p", "trainer.experiment_name=e", "trainer.save_freq=10", "trainer.test_freq=5",
        "model.enable_gradient_checkpointing=true", "ulysses_sequence_parallel_size=1",
        "use_remove_padding=true",
        "data.multiturn.enable=false",
    ])
    d, t = cfg.data, cfg.trainer
    assert d.train_files == "/d/train.parquet" and d.val_files is None
    assert d.prompt_dict_keys == ["question"] and d.response_dict_keys == ["answer"]
    sizes = (d.micro_batch_size_per_gpu, d.max_length, d.truncation, d.train_batch_size)
    assert sizes == (8, 512, "left", 256)
    assert cfg.model.path == "/m/qwen" and cfg.model.enable_gradient_checkpointing
    assert cfg.actor.lr == 1e-4 and cfg.actor.lr_warmup_steps == 5 and cfg.actor.lr_scheduler == "cosine"
    assert cfg.actor.weight_decay == 0.01 and tuple(cfg.actor.betas) == (0.9, 0.95)  # verl's SFT defaults
    assert (t.output_dir, t.total_steps, t.save_freq, t.test_freq) == ("/out", 50, 10, 5)
    assert t.logger == ["console", "jsonl", "wandb"]


@pytest.mark.parametrize("word, says", [
    ("ulysses_sequence_parallel_size=2", "ulysses_sequence_parallel_size=2 is not supported"),
    ("model.trust_remote_code=true", "model.trust_remote_code=True is not supported"),
    ("data.custom_cls.path=my.py", "data.custom_cls.path='my.py' is not supported"),
    ("optim.warmup_steps_ratio=0.1", "needs trainer.total_training_steps"),
    ("data.bogus=1", "verl key data.bogus=1 has no spmdrl equivalent"),
])
def test_unsupported_verl_sft_keys_stop_with_one_sentence(word, says):
    with pytest.raises(ConfigError, match=says):
        parse_sft_config(["data.train_files=/d.parquet", word])


def test_verl_sft_lora_keys_mean_lora():
    cfg, _ = parse_sft_config(["data.train_files=/d.parquet", "model.lora_rank=32", "model.lora_alpha=64",
                               "model.target_modules=[q_proj,v_proj]"])
    m = cfg.model
    assert (m.lora_rank, m.lora_alpha, list(m.target_modules)) == (32, 64, ["q_proj", "v_proj"])


def test_rl_only_keys_are_refused():
    cfg, _ = parse_sft_config(["--actor.ppo_epochs", "2"])
    with pytest.raises(ConfigError, match=r"actor.ppo_epochs=2 is an RL key that spmdrl.sft does not use"):
        check_sft_config(cfg, 1)
    cfg, _ = parse_sft_config(["--data.train_batch_size", "3"])
    with pytest.raises(ConfigError, match="multiple of the world size 2"):
        check_sft_config(cfg, 2)
    check_sft_config(parse_sft_config([])[0], 2)
    # A renamed RL key is refused under its new name, its old one included.
    cfg, _ = parse_sft_config(["--trainer.colocate", "false"])
    with pytest.raises(ConfigError, match="trainer.sleep_rollout=False is an RL key"):
        check_sft_config(cfg, 1)
    cfg, _ = parse_sft_config(["--trainer.val_only", "true", "--data.val_files", "null"])
    with pytest.raises(ConfigError, match="trainer.val_only is true but data.val_files is null"):
        check_sft_config(cfg, 1)
