"""Cheap checks that a Hugging Face model folder is usable, run before any process group or model exists.

    validate_model_folder("/models/qwen", "model.path")        # raises ValueError with one sentence

A bad folder otherwise fails minutes later on every rank, deep inside
transformers. Nothing here loads weights: config.json is parsed, the weight
files' safetensors headers are read (or the files' presence checked for
pickled ``.bin`` files, which are never unpickled here), and the tokenizer is
loaded (small). Which architectures a rollout engine can run is that engine's
own check (``RolloutEngine.check_config``).
"""

from __future__ import annotations

import json
from pathlib import Path

_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
            "pytorch_model.bin.index.json")
_TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


def read_config(path: str | Path, key: str) -> dict:
    """config.json of the folder ``key`` names, parsed and checked for what every engine needs."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"{key} {str(path)!r} is not a folder; give a Hugging Face model folder or "
                         f"builtin:tiny")
    f = folder / "config.json"
    if not f.is_file():
        raise ValueError(f"{key} {str(path)!r} has no config.json; it is not a Hugging Face model folder")
    try:
        cfg = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{key}: {str(f)!r} is not valid JSON ({_first_line(err)})") from err
    if not isinstance(cfg, dict):
        raise ValueError(f"{key}: {str(f)!r} holds a {type(cfg).__name__}, not a JSON object")
    model_type = cfg.get("model_type")
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"{key}: model_type {model_type!r} in {str(f)!r} is not an architecture "
                         f"transformers knows; give a folder saved by save_pretrained")
    missing = [k for k in _REQUIRED if k not in cfg]
    if missing and not any(isinstance(v, dict) and all(k in v for k in missing) for v in cfg.values()):
        raise ValueError(f"{key}: {str(f)!r} lacks {', '.join(missing)}; it is not a decoder-only LM config")
    return cfg


def _check_weights(folder: Path, key: str) -> None:
    from safetensors import safe_open

    present = [n for n in _WEIGHTS if (folder / n).is_file()]
    if not present:
        raise ValueError(f"{key} {str(folder)!r} has no weights: expected one of {', '.join(_WEIGHTS)}")
    name = present[0]
    files = [name]
    if name.endswith(".index.json"):
        try:
            files = sorted(set(json.loads((folder / name).read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError, TypeError) as err:
            raise ValueError(f"{key}: {str(folder / name)!r} is not a weight index "
                             f"({_first_line(err)})") from err
        absent = [f for f in files if not (folder / f).is_file()]
        if absent:
            raise ValueError(f"{key}: {str(folder / name)!r} names {absent[0]!r}, which is not in the folder")
    for f in files:
        if f.endswith(".safetensors"):
            try:
                with safe_open(str(folder / f), framework="pt") as handle:
                    handle.keys()
            except Exception as err:  # safetensors raises its own types for a truncated or foreign file
                raise ValueError(f"{key}: {str(folder / f)!r} is not a readable safetensors file "
                                 f"({_first_line(err)})") from err


def validate_tokenizer_folder(path: str | Path, key: str) -> None:
    """The folder ``key`` names holds tokenizer files that transformers loads."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"{key} {str(path)!r} is not a folder; give a folder with tokenizer files")
    if not any((folder / n).is_file() for n in _TOKENIZER):
        raise ValueError(f"{key} {str(path)!r} has no tokenizer (none of {', '.join(_TOKENIZER)})")
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(str(folder))
    except Exception as err:  # transformers and tokenizers raise many types for a broken file
        raise ValueError(f"{key}: the tokenizer in {str(path)!r} does not load ({_first_line(err)})") from err


def validate_model_folder(path: str | Path, key: str, *, need_tokenizer: bool = True) -> None:
    """config.json (a known architecture, a decoder config), weight files with readable headers, and
    (with ``need_tokenizer``) a tokenizer that loads; raises ValueError naming ``key``, the path and the
    fault."""
    read_config(path, key)
    _check_weights(Path(path), key)
    if need_tokenizer:
        validate_tokenizer_folder(path, key)
