"""Cheap checks that a Hugging Face model folder is usable, run before any process group or model exists.

    validate_model_folder("/models/qwen", "model.path")        # raises ValueError with one sentence

A bad folder otherwise fails minutes later on every rank, deep inside
transformers. Nothing here loads weights: config.json is parsed and its sizes
and rope settings checked, the model is built on the meta device (no memory)
and its tensor shapes compared with the safetensors headers, and the tokenizer
is loaded (small) and compared with the vocabulary. Pickled ``.bin`` weights
are refused: loading them would unpickle untrusted files. Which architectures
a rollout engine can run is that engine's own check
(``RolloutEngine.check_config``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# What every engine builds a decoder from (the MLP's width too: a config.json without it failed deep inside
# an engine with a bare KeyError).
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")
# Sizes that must be integers >= 1 where config.json gives them.
_SIZES = (*_REQUIRED, "num_key_value_heads", "intermediate_size", "head_dim", "max_position_embeddings")
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
_PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json")
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
        raise ValueError(f"{key}: {str(f)!r} lacks {', '.join(missing)}, which every engine needs; it is not "
                         f"a decoder-only LM config")
    _check_sizes(text_config(cfg), f, key)
    return cfg


def text_config(cfg: dict) -> dict:
    """The part of a parsed config.json that holds the decoder's sizes (itself, or e.g. its text_config)."""
    if all(k in cfg for k in _REQUIRED):
        return cfg
    return next(v for v in cfg.values() if isinstance(v, dict) and all(k in v for k in _REQUIRED))


def _check_sizes(c: dict, f: Path, key: str) -> None:
    """Sizes that are integers >= 1, heads that divide the hidden size and each other, and rope settings
    transformers can build."""
    for k in _SIZES:
        v = c.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{key}: {k} is {v!r} in {str(f)!r}; it must be an integer >= 1")
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
    if heads % kv:
        raise ValueError(f"{key}: num_key_value_heads ({kv}) does not divide num_attention_heads ({heads}) "
                         f"in {str(f)!r}; each key/value head serves a whole group of query heads")
    if c.get("head_dim") is None and c["hidden_size"] % heads:
        raise ValueError(f"{key}: hidden_size ({c['hidden_size']}) is not divisible by num_attention_heads "
                         f"({heads}) in {str(f)!r} and no head_dim is given")
    _check_rope(c, f, key)


def check_sp_heads(sp: int, c: dict, what: str) -> None:
    """One sentence when sequence parallelism of degree ``sp`` cannot split the attention heads of the model
    whose decoder sizes ``c`` holds (Ulysses gives each SP rank heads/sp query heads; key/value heads that sp
    does not divide are repeated to the query heads)."""
    heads = c["num_attention_heads"]
    if heads % sp:
        raise ValueError(f"parallel.sp is {sp}, which does not divide the {heads} attention heads of {what} "
                         f"({c.get('num_key_value_heads') or heads} key/value heads); choose an sp that "
                         f"divides {heads}")


def _check_rope(c: dict, f: Path, key: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theta = c.get("rope_theta")
    if theta is not None and (not isinstance(theta, (int, float)) or theta <= 0):
        raise ValueError(f"{key}: rope_theta is {theta!r} in {str(f)!r}; it must be a number > 0")
    for field in ("rope_scaling", "rope_parameters"):
        value = c.get(field)
        if value is None:
            continue
        # One dict, or one per attention type (layer_types) in newer configs.
        params = list(value.values()) if isinstance(value, dict) and value and all(
            isinstance(v, dict) for v in value.values()) else [value]
        for p in params:
            if not isinstance(p, dict):
                raise ValueError(f"{key}: {field} is {p!r} in {str(f)!r}; it must be a mapping or null")
            kind = p.get("rope_type", p.get("type", "default"))
            if kind != "default" and kind not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"{key}: {field} has rope_type {kind!r} in {str(f)!r}; transformers knows "
                                 f"default, {', '.join(ROPE_INIT_FUNCTIONS)}")
            for name in ("factor", "rope_theta"):
                v = p.get(name)
                if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0):
                    raise ValueError(f"{key}: {field}.{name} is {v!r} in {str(f)!r}; it must be a number > 0")


def _check_weights(folder: Path, key: str) -> dict[str, list[int]]:
    """The shape of every tensor in the folder's safetensors files, from their headers."""
    from safetensors import safe_open

    present = [n for n in _WEIGHTS if (folder / n).is_file()]
    if not present and any((folder / n).is_file() for n in _PICKLED):
        raise ValueError(f"{key} {str(folder)!r} holds only pickled weights ({', '.join(_PICKLED)}), which "
                         f"spmdrl does not load because unpickling runs code; convert them to safetensors "
                         f"(save_pretrained(safe_serialization=True))")
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
    shapes: dict[str, list[int]] = {}
    for f in files:
        if not f.endswith(".safetensors"):
            raise ValueError(f"{key}: {str(folder / name)!r} names {f!r}, which is not a safetensors file")
        try:
            with safe_open(str(folder / f), framework="pt") as handle:
                shapes.update({k: list(handle.get_slice(k).get_shape()) for k in handle.keys()})
        except Exception as err:  # safetensors raises its own types for a truncated or foreign file
            raise ValueError(f"{key}: {str(folder / f)!r} is not a readable safetensors file "
                             f"({_first_line(err)})") from err
    return shapes


def _check_shapes(folder: Path, cfg: dict, shapes: dict[str, list[int]], key: str) -> None:
    """The weights fit the model config.json describes: built on the meta device (no memory), every tensor
    the files share with it has its shape, and none of its parameters is missing from the files."""
    import torch
    import transformers

    args = {k: v for k, v in cfg.items() if k != "model_type"}
    arch = (cfg.get("architectures") or [""])[0]
    try:
        conf = transformers.CONFIG_MAPPING[cfg["model_type"]](**args)
        # The class config.json names (a reward model's *ForSequenceClassification) when it fits the config.
        cls = getattr(transformers, arch, None) if arch.isidentifier() else None
        with torch.device("meta"):
            if isinstance(cls, type) and getattr(cls, "config_class", None) is type(conf):
                model = cls(conf)
            else:
                model = transformers.AutoModelForCausalLM.from_config(conf)
    except Exception as err:  # transformers' own validation: many exception types
        raise ValueError(f"{key}: transformers cannot build the model {str(folder / 'config.json')!r} "
                         f"describes ({_first_line(err)})") from err
    want = {k: list(v.shape) for k, v in model.state_dict().items()}
    prefix = getattr(model, "base_model_prefix", "")

    def name(k: str) -> str:  # a base model's file loads into a head model under its prefix, and back
        for n in (k, f"{prefix}.{k}", k.removeprefix(f"{prefix}.")):
            if n in want:
                return n
        return k

    found = {name(k): s for k, s in shapes.items()}
    for k, s in found.items():
        if k in want and want[k] != s:
            raise ValueError(f"{key}: tensor {k!r} in {str(folder)!r} has shape {s}, but config.json makes "
                             f"it {want[k]}; the weights belong to another config")
    params = [n for n, _ in model.named_parameters()]  # a tied weight once
    absent = [n for n in params if n not in found]
    if absent and len(absent) < len(params) / 2:  # else the files name tensors another way: loading decides
        raise ValueError(f"{key}: {str(folder)!r} lacks {len(absent)} of the model's {len(params)} weights "
                         f"(first: {absent[0]!r}); they would start random")


def validate_tokenizer_folder(path: str | Path, key: str) -> Any:
    """The folder ``key`` names holds tokenizer files that transformers loads; returns the tokenizer."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"{key} {str(path)!r} is not a folder; give a folder with tokenizer files")
    if not any((folder / n).is_file() for n in _TOKENIZER):
        raise ValueError(f"{key} {str(path)!r} has no tokenizer (none of {', '.join(_TOKENIZER)})")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as err:  # transformers and tokenizers raise many types for a broken file
        raise ValueError(f"{key}: the tokenizer in {str(path)!r} does not load ({_first_line(err)})") from err


def check_vocab(cfg: dict, tokenizer: Any, key: str, path: str | Path) -> None:
    """The model's embedding has a row for every token the tokenizer can produce."""
    vocab = text_config(cfg)["vocab_size"]
    if len(tokenizer) > vocab:
        raise ValueError(f"{key}: vocab_size ({vocab}) in {str(Path(path) / 'config.json')!r} is smaller "
                         f"than the tokenizer's {len(tokenizer)} tokens; token ids past it have no "
                         f"embedding row")


def validate_model_folder(path: str | Path, key: str, *, need_tokenizer: bool = True) -> None:
    """config.json (a known architecture, a decoder config), weight files with readable headers, and
    (with ``need_tokenizer``) a tokenizer that loads; raises ValueError naming ``key``, the path and the
    fault."""
    cfg = read_config(path, key)
    _check_shapes(Path(path), cfg, _check_weights(Path(path), key), key)
    if need_tokenizer:
        check_vocab(cfg, validate_tokenizer_folder(path, key), key, path)
