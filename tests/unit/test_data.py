"""Prompt loading: parquet layouts, truncation modes, rank shares, exact resume, validation batches."""

from __future__ import annotations

from pathlib import Path

import pytest

from spmdrl.builtin.tasks import generate_arith, write_parquet
from spmdrl.config import DataConfig
from spmdrl.data import PromptDataset, PromptLoader, ValidationLoader, build_train_loader, build_val_loader


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def arith_file(tmp_path: Path) -> Path:
    return write_parquet(generate_arith("train", 40, seed=0), tmp_path / "arith.parquet")


def _dataset(path, tok, **kw) -> PromptDataset:
    return PromptDataset(path, tok, **kw)


def test_chat_messages_round_trip(arith_file: Path, tok) -> None:
    ds = _dataset(arith_file, tok, max_prompt_length=64)
    rows = generate_arith("train", 40, seed=0)
    assert len(ds) == 40 and ds.num_filtered == 0
    item = ds[3]
    content = rows[3]["prompt"][0]["content"]
    assert item.raw_prompt == f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
    assert item.prompt_ids == tok(item.raw_prompt, add_special_tokens=False)["input_ids"]
    assert tok.decode(item.prompt_ids) == item.raw_prompt
    assert item.index == 3 and item.data_source == "spmdrl/arith"
    assert item.ground_truth == rows[3]["reward_model"]["ground_truth"]
    assert item.extra_info == rows[3]["extra_info"]


def test_plain_strings_and_several_files(tmp_path: Path, arith_file: Path, tok) -> None:
    plain = write_parquet(
        [{"question": "Say hi", "data_source": "custom", "reward_model": {"ground_truth": "hi"}},
         {"question": "Say bye", "data_source": "custom", "reward_model": {"ground_truth": "bye"}}],
        tmp_path / "plain.parquet",
    )
    ds = PromptDataset([str(plain)], tok, prompt_key="question", max_prompt_length=8)
    assert [i.raw_prompt for i in ds.items] == ["Say hi", "Say bye"]
    assert ds[1].prompt_ids == tok("Say bye")["input_ids"] and ds[1].extra_info == {}
    mixed = write_parquet(generate_arith("val", 3, seed=0), tmp_path / "a2.parquet")
    two = PromptDataset([str(arith_file), str(mixed)], tok, max_prompt_length=64)
    assert len(two) == 43 and [i.index for i in two.items] == list(range(43))
    no_template = PromptDataset(str(mixed), tok, max_prompt_length=64, apply_chat_template=False)
    assert no_template[0].raw_prompt == generate_arith("val", 3, seed=0)[0]["prompt"][0]["content"]


def test_truncation_modes(tmp_path: Path, tok) -> None:
    rows = [{"prompt": "a b c d e f g h i j k l", "data_source": "x"},
            {"prompt": "short", "data_source": "x"}]
    path = write_parquet(rows, tmp_path / "long.parquet")
    full = tok("a b c d e f g h i j k l")["input_ids"]
    assert len(full) > 6
    with pytest.raises(ValueError,
                       match=r"row 0 in .*long\.parquet.* has \d+ tokens, over data.max_prompt_length=6"):
        PromptDataset(path, tok, max_prompt_length=6, truncation="error")
    assert PromptDataset(path, tok, max_prompt_length=6, truncation="left")[0].prompt_ids == full[-6:]
    assert PromptDataset(path, tok, max_prompt_length=6, truncation="right")[0].prompt_ids == full[:6]
    filtered = PromptDataset(path, tok, max_prompt_length=6, truncation="filter")
    assert filtered.num_filtered == 1 and len(filtered) == 1 and filtered[0].raw_prompt == "short"
    assert filtered[0].index == 0
    with pytest.raises(ValueError, match="no prompts left"):
        PromptDataset(path, tok, max_prompt_length=1, truncation="filter")
    with pytest.raises(ValueError, match="data.truncation='middle' is not one of error, left, right, filter"):
        PromptDataset(path, tok, truncation="middle")


def test_clear_errors(tmp_path: Path, arith_file: Path, tok) -> None:
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        PromptDataset(str(tmp_path / "missing.parquet"), tok)
    with pytest.raises(ValueError,
                       match=r"no prompt column 'question' \(data.prompt_key\); columns: .*prompt"):
        PromptDataset(arith_file, tok, prompt_key="question")
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"this is not parquet")
    with pytest.raises(ValueError, match="cannot read .*junk.parquet.* as parquet"):
        PromptDataset(str(junk), tok)
    bad = write_parquet([{"prompt": 5}], tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="neither a string nor a list of chat messages"):
        PromptDataset(bad, tok)


def _global_batches(ds: PromptDataset, world: int, steps: int, **kw) -> list[list[int]]:
    """Concatenate the ranks' shares of each step, checking they are disjoint and equal-sized."""
    loaders = [PromptLoader(ds, batch_size=8, rank=r, world_size=world, seed=7, **kw) for r in range(world)]
    batches = []
    for _ in range(steps):
        shares = [[item.index for item in next(ld)] for ld in loaders]
        assert all(len(s) == 8 // world for s in shares)
        flat = [i for s in shares for i in s]
        assert len(set(flat)) == len(flat)
        batches.append(flat)
    return batches


def test_rank_shares_are_disjoint_and_match_one_rank(arith_file: Path, tok) -> None:
    ds = _dataset(arith_file, tok, max_prompt_length=64)
    one = _global_batches(ds, 1, steps=12)  # 40 prompts / 8 = 5 steps per epoch: crosses two epoch boundaries
    assert _global_batches(ds, 2, steps=12) == one
    assert _global_batches(ds, 4, steps=12) == one
    epoch0 = [i for b in one[:5] for i in b]
    assert sorted(epoch0) == list(range(40))  # each prompt once per epoch
    assert one[:5] != one[5:10]  # reshuffled for the next epoch
    unshuffled = _global_batches(ds, 2, steps=2, shuffle=False)
    assert unshuffled == [list(range(8)), list(range(8, 16))]


def test_drop_last_and_num_epochs(tmp_path: Path, tok) -> None:
    ds = _dataset(write_parquet(generate_arith("train", 20, seed=0), tmp_path / "a.parquet"), tok,
                  max_prompt_length=64)
    loader = PromptLoader(ds, batch_size=8, rank=0, world_size=1, seed=0, num_epochs=2)
    assert loader.steps_per_epoch == 2
    assert not loader.exhausted
    assert len(list(loader)) == 4  # 2 full batches per epoch; the 4 leftover prompts are dropped
    assert loader.exhausted and not PromptLoader(ds, batch_size=8, rank=0, world_size=1).exhausted
    with pytest.raises(ValueError, match="multiple of the world size 3"):
        PromptLoader(ds, batch_size=8, rank=0, world_size=3)
    with pytest.raises(ValueError, match="larger than the training set"):
        PromptLoader(ds, batch_size=32, rank=0, world_size=1)


def test_resume_mid_epoch_reproduces_sequence(arith_file: Path, tok) -> None:
    ds = _dataset(arith_file, tok, max_prompt_length=64)
    ref = PromptLoader(ds, batch_size=8, rank=1, world_size=2, seed=3)
    expected = [[i.index for i in next(ref)] for _ in range(9)]
    first = PromptLoader(ds, batch_size=8, rank=1, world_size=2, seed=3)
    got = [[i.index for i in next(first)] for _ in range(3)]
    state = first.state_dict()
    assert state["epoch"] == 0 and state["position"] == 3
    resumed = PromptLoader(ds, batch_size=8, rank=1, world_size=2, seed=3)
    resumed.load_state_dict(dict(state))
    got += [[i.index for i in next(resumed)] for _ in range(6)]
    assert got == expected
    with pytest.raises(ValueError, match="seed=3, but this run has 4"):
        PromptLoader(ds, batch_size=8, rank=0, world_size=1, seed=4).load_state_dict(state)
    # A changed data.shuffle would repeat or skip prompts of the epoch: refused, naming the key.
    with pytest.raises(ValueError, match=r"shuffle=1, but this run has 0 \(data.shuffle\)"):
        PromptLoader(ds, batch_size=8, rank=0, world_size=1, seed=3, shuffle=False).load_state_dict(state)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_validation_covers_everything_without_drop(tmp_path: Path, tok, world: int) -> None:
    ds = _dataset(write_parquet(generate_arith("val", 21, seed=0), tmp_path / "v.parquet"), tok,
                  max_prompt_length=64)
    loaders = [ValidationLoader(ds, batch_size=8, rank=r, world_size=world) for r in range(world)]
    assert all(len(ld) == 3 for ld in loaders)
    seen = []
    for shares in zip(*loaders):  # every rank yields the same number of batches
        seen += [i.index for share in shares for i in share]
    assert seen == list(range(21))


def test_build_loaders_from_config_with_builtin(tmp_path: Path, monkeypatch, tok) -> None:
    from spmdrl.builtin import resolve_builtins
    from spmdrl.config import Config

    monkeypatch.setenv("SPMDRL_CACHE", str(tmp_path))
    cfg = resolve_builtins(Config(data=DataConfig(train_batch_size=16, val_batch_size=64))).data
    train = build_train_loader(cfg, tok, rank=1, world_size=2, seed=1)
    batch = next(train)
    assert len(batch) == 8 and all(i.data_source == "spmdrl/arith" for i in batch)
    val = build_val_loader(cfg, tok, rank=0, world_size=2)
    assert val is not None and len(val) == 2
    cfg.val_files = None
    assert build_val_loader(cfg, tok, rank=0, world_size=2) is None
