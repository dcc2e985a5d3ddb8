"""Model folder validation: a broken folder stops the run before any work, with one sentence and exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from spmdrl.config.model_folder import validate_model_folder, validate_tokenizer_folder
from spmdrl.train import main


def _break(folder: Path, how: str) -> None:
    cfg = folder / "config.json"
    if how == "no config":
        cfg.unlink()
    elif how == "bad json":
        cfg.write_text("{not json")
    elif how == "unknown architecture":
        cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "model_type": "no_such_model"}))
    elif how == "not a decoder config":
        data = json.loads(cfg.read_text())
        del data["num_hidden_layers"]
        cfg.write_text(json.dumps(data))
    elif how == "no weights":
        (folder / "model.safetensors").unlink()
    elif how == "truncated weights":
        (folder / "model.safetensors").write_bytes(b"0123456789")
    elif how == "index names a missing shard":
        (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
        index = {"weight_map": {"a": "model-00001-of-00002.safetensors",
                                "b": "model-00002-of-00002.safetensors"}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    elif how == "no tokenizer":
        for f in folder.glob("tokenizer*"):
            f.unlink()
    elif how == "broken tokenizer":
        (folder / "tokenizer.json").write_text("{broken")
        (folder / "tokenizer_config.json").write_text(
            json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


CASES = {
    "no config": "has no config.json",
    "bad json": "is not valid JSON",
    "unknown architecture": "model_type 'no_such_model'",
    "not a decoder config": "lacks num_hidden_layers",
    "no weights": "has no weights: expected one of model.safetensors",
    "truncated weights": "is not a readable safetensors file",
    "index names a missing shard": "names 'model-00002-of-00002.safetensors', which is not in the folder",
    "no tokenizer": "has no tokenizer",
    "broken tokenizer": "the tokenizer in",
}


@pytest.fixture
def folder(tiny_model_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


def test_intact_folder_passes(folder):
    validate_model_folder(folder, "model.path")
    validate_tokenizer_folder(folder, "model.tokenizer_path")


@pytest.mark.parametrize("how", list(CASES))
def test_each_fault_is_one_sentence_naming_key_and_path(folder, how):
    _break(folder, how)
    with pytest.raises(ValueError) as err:
        validate_model_folder(folder, "model.path")
    text = str(err.value)
    assert CASES[how] in text and text.startswith("model.path") and str(folder) in text
    assert "\n" not in text


def test_the_cli_stops_before_any_work(folder, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    _break(folder, "truncated weights")
    with pytest.raises(SystemExit) as exit_:
        main(["--config", "configs/grpo.yaml", "--model.path", str(folder)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "is not a readable safetensors file" in err


def test_an_architecture_the_native_engine_lacks(folder, capsys, monkeypatch):
    """A folder transformers can load but the native decoder does not implement: the engine's own check."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "mistral", "sliding_window": None}))
    with pytest.raises(SystemExit) as exit_:
        main(["--config", "configs/grpo.yaml", "--model.path", str(folder)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "model_type 'mistral'" in err and "rollout.engine: hf runs others" in err
