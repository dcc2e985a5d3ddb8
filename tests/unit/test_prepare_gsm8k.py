"""GSM8K JSONL -> verl's parquet (spmdrl.builtin.gsm8k), read back by spmdrl's loader and scorer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spmdrl.builtin.gsm8k import INSTRUCTION, main

TRAIN = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
     "answer": "He has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"},
    {"question": "A car costs $1,200 and a bike $300. What do both cost?",
     "answer": "1,200 + 300 = <<1200+300=1500>>1,500\n#### 1,500"},
    {"question": "It was 5 degrees and fell by 8. What is it now?", "answer": "5 - 8 = -3\n#### -3"},
]
TEST = [{"question": "What is 6 times 7?", "answer": "6 * 7 = <<6*7=42>>42\n#### 42"}]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def prepared(tmp_path: Path) -> Path:
    train = _jsonl(tmp_path / "train.jsonl", TRAIN)
    test = _jsonl(tmp_path / "gsm8k_test.jsonl", TEST)
    assert main(["--input", str(train), str(test), "--out", str(tmp_path / "out")]) == 0
    return tmp_path / "out"


def test_rows_are_verls_layout(prepared: Path):
    import pyarrow.parquet as pq

    train = pq.read_table(prepared / "train.parquet")
    assert train.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    rows = train.to_pylist()
    assert [r["reward_model"] for r in rows] == [{"style": "rule", "ground_truth": g}
                                                 for g in ("7", "1500", "-3")]
    first = rows[1]
    assert first["data_source"] == "openai/gsm8k" and first["ability"] == "math"
    assert first["prompt"] == [{"role": "user", "content": TRAIN[1]["question"] + " " + INSTRUCTION}]
    assert INSTRUCTION == 'Let\'s think step by step and output the final answer after "####".'
    assert first["extra_info"] == {"split": "train", "index": 1, "answer": TRAIN[1]["answer"],
                                   "question": TRAIN[1]["question"]}
    test = pq.read_table(prepared / "test.parquet").to_pylist()
    assert len(test) == 1 and test[0]["extra_info"]["split"] == "test" and test[0]["extra_info"]["index"] == 0


def test_loads_through_spmdrl_and_scores_with_gsm8k(prepared: Path, tiny_model_dir: Path):
    from transformers import AutoTokenizer

    from spmdrl.data import PromptDataset
    from spmdrl.reward.scorers import compute_score

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ds = PromptDataset(prepared / "train.parquet", tok, max_prompt_length=1024)
    assert len(ds.items) == 3
    item = ds.items[1]
    assert item.data_source == "openai/gsm8k" and item.ground_truth == "1500"
    assert "<|im_start|>user\n" + TRAIN[1]["question"] in item.raw_prompt  # the tokenizer's chat template
    assert compute_score(item.data_source, "so it costs 1,500 dollars.\n#### 1,500", item.ground_truth) == 1.0
    assert compute_score(item.data_source, "#### 1400", item.ground_truth) == 0.0
    assert compute_score(ds.items[2].data_source, "#### -3", ds.items[2].ground_truth) == 1.0


def test_bad_input_is_one_sentence(tmp_path: Path, capsys):
    bad = _jsonl(tmp_path / "train.jsonl", [{"question": "q", "answer": "no final answer"}])
    assert main(["--input", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "train.jsonl:1: the answer has no '#### <number>' final answer" in capsys.readouterr().err
    odd = _jsonl(tmp_path / "gsm8k.jsonl", TEST)
    assert main(["--input", str(odd), "--out", str(tmp_path / "o")]) == 2
    assert "its name must contain 'train' or 'test'" in capsys.readouterr().err
