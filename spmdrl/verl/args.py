"""verl's command line and YAML files, rewritten into spmdrl's: runs before jsonargparse.

    python -m spmdrl.train data.train_batch_size=256 actor_rollout_ref.actor.optim.lr=1e-6 ...
    torchrun --standalone --nproc-per-node 8 -m spmdrl.train --verl-config my.yaml trainer.n_gpus_per_node=8

``rewrite_argv`` takes the Hydra-style ``key=value`` words and the
``--verl-config FILE`` out of the command line, translates them through
``spmdrl.verl.compat.TABLE`` and hands the result to jsonargparse as one YAML
``--config`` string, so types, ``--print_config`` and spmdrl's checks apply
unchanged. Precedence, lowest first: spmdrl's defaults; verl's defaults in
``VERL_DEFAULTS`` (only when the run is given in verl terms and without
``--config``, so a verl command line means what it means in verl);
``--config`` files; ``--verl-config`` files; verl ``key=value`` words;
``--section.key`` flags.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any, Optional, Sequence

import yaml

from spmdrl.errors import ConfigError
from spmdrl.verl.compat import TABLE, VERL_DEFAULTS, Rule, check_world_size, rule_for, translate

_OVERRIDE = re.compile(r"^(\+{0,2})([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)+)=(.*)$", re.S)
# An undotted key: verl's SFT trainer has a few (ulysses_sequence_parallel_size=1).
_TOP_LEVEL = re.compile(r"^(\+{0,2})([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)
_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
_INT = re.compile(r"^[-+]?\d+$")


def parse_value(text: str) -> Any:
    """A Hydra override value: null, true/false, int, float (1e-6 too), [list], {dict}, 'quoted' or a
    string."""
    s = text.strip()
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"":
        return s[1:-1]
    low = s.lower()
    if low in ("null", "~"):
        return None
    if low in ("true", "false"):
        return low == "true"
    if _INT.match(s):
        return int(s)
    if _FLOAT.match(s):
        return float(s)
    if s[:1] in "[{":
        try:
            loaded = yaml.safe_load(s)
        except yaml.YAMLError as err:
            raise ConfigError(f"cannot read the value {s!r}: {' '.join(str(err).split())}") from err
        return _numbers(loaded)
    return s


def _numbers(value: Any) -> Any:
    """YAML reads 1e-6 as a string; Hydra (OmegaConf) reads it as a float. Follow Hydra."""
    if isinstance(value, str) and _FLOAT.match(value.strip()) and not _INT.match(value.strip()):
        return float(value)
    if isinstance(value, list):
        return [_numbers(v) for v in value]
    if isinstance(value, dict):
        return {k: _numbers(v) for k, v in value.items()}
    return value


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, path + "."))
        else:
            out[path] = value
    return out


def _unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        node = tree
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def load_verl_yaml(path: str) -> dict[str, Any]:
    """A verl YAML file, flattened; Hydra's ``defaults``/``hydra`` entries are composition, not settings."""
    try:
        with open(path) as f:
            tree = yaml.safe_load(f) or {}
    except OSError as err:
        raise ConfigError(f"--verl-config {path!r} cannot be read: {err.strerror}") from err
    except yaml.YAMLError as err:
        raise ConfigError(f"--verl-config {path!r} is not valid YAML: {' '.join(str(err).split())}") from err
    if not isinstance(tree, dict):
        raise ConfigError(f"--verl-config {path!r} must hold a mapping of verl sections, not "
                          f"{type(tree).__name__}")
    tree = {k: v for k, v in tree.items() if k not in ("defaults", "hydra")}
    return {k: _numbers(v) for k, v in _flatten(tree).items()}


_REF = re.compile(r"\$\{([A-Za-z0-9_.]+)\}")


def _resolve_interpolations(flat: dict[str, Any], where: str) -> None:
    """``${a.b.c}`` references to other keys of the run's verl config, as Hydra resolves them: a whole value
    takes the other key's value (and type), a reference inside a string its text."""
    for _ in range(len(flat) + 1):
        pending = {k: v for k, v in flat.items() if isinstance(v, str) and "${" in v}
        if not pending:
            return
        for key, value in pending.items():
            refs = _REF.findall(value)
            if not refs or any(r not in flat for r in refs) or value.count("${") != len(refs):
                raise ConfigError(f"{where}: {key}={value!r} is an interpolation spmdrl cannot resolve; "
                                  f"write the value itself")
            if key in refs:
                raise ConfigError(f"{where}: {key} refers to itself through interpolations (a cycle)")
            whole = _REF.fullmatch(value.strip())
            flat[key] = flat[whole.group(1)] if whole else _REF.sub(lambda mt: str(flat[mt.group(1)]), value)
    raise ConfigError(f"{where}: the interpolations of {', '.join(sorted(pending))} never resolve (a cycle)")


def split_argv(argv: Sequence[str], table: Optional[list[Rule]] = None
               ) -> tuple[list[str], list[str], dict[str, Any], list[str]]:
    """argv -> (--config words, --verl-config files, verl key=value overrides, every other word). An undotted
    ``key=value`` is a verl word only when ``table`` has a row for it (verl's SFT trainer has a few)."""
    configs: list[str] = []
    verl_files: list[str] = []
    overrides: dict[str, Any] = {}
    rest: list[str] = []
    words = list(argv)
    i = 0
    while i < len(words):
        w = words[i]
        for flag, bucket in (("--config", configs), ("--verl-config", verl_files),
                             ("--verl_config", verl_files)):
            if w == flag:
                if i + 1 >= len(words):
                    raise ConfigError(f"{flag} needs a file")
                bucket.append(words[i + 1])
                i += 2
                break
            if w.startswith(flag + "="):
                bucket.append(w[len(flag) + 1:])
                i += 1
                break
        else:
            match = _OVERRIDE.match(w) or _TOP_LEVEL.match(w)
            if match and ("." in match.group(2) or rule_for(match.group(2), table) is not None):
                overrides[match.group(2)] = parse_value(match.group(3))
            else:
                rest.append(w)
            i += 1
    return configs, verl_files, overrides, rest


def rewrite_argv(argv: Sequence[str], world_size: Optional[int] = None, *, table: list[Rule] = TABLE,
                 defaults: Optional[dict[str, Any]] = None, config_cls: Optional[type] = None,
                 prog: str = "spmdrl.train") -> tuple[list[str], dict[str, str]]:
    """Replace verl words by one YAML ``--config`` in precedence order; returns (argv, spmdrl key -> verl
    key). ``table``, ``defaults`` and ``config_cls`` (whose keys are spmdrl's): the RL trainer's by default,
    ``spmdrl.verl.sft``'s for ``spmdrl.sft``.

    An argv without verl words comes back unchanged. Raises ConfigError with one sentence.
    """
    configs, verl_files, overrides, rest = split_argv(argv, table)
    if not verl_files and not overrides:
        return list(argv), {}
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    verl: dict[str, Any] = dict(VERL_DEFAULTS if defaults is None else defaults) if not configs else {}
    for path in verl_files:
        verl.update(load_verl_yaml(path))
    verl.update(overrides)
    _resolve_interpolations(verl, "verl config")
    # Outside torchrun (WORLD_SIZE unset), --print_config shows the config of a run meant for more ranks.
    if not (any(w.startswith("--print_config") for w in rest) and "WORLD_SIZE" not in os.environ):
        check_world_size(verl, world)
    flat, origin, notes = translate(verl, world, table=table, config_cls=config_cls,
                                    given=_keys_set_by(configs))
    if notes and os.environ.get("RANK", "0") == "0":
        print(f"{prog}: info: verl keys accepted with no effect here: {'; '.join(notes)}",
              file=sys.stderr)
    out: list[str] = []
    for c in configs:
        out += ["--config", c]
    out += ["--config", yaml.safe_dump(_unflatten(flat), default_flow_style=True, width=1 << 30).strip()]
    return out + rest, origin


def _keys_set_by(configs: Sequence[str]) -> set[str]:
    """The spmdrl keys the ``--config`` words set (a YAML file, or YAML text as jsonargparse takes it), so
    that verl's linked defaults do not override them; what does not read is left to jsonargparse to
    report."""
    keys: set[str] = set()
    for word in configs:
        try:
            text = open(word).read() if os.path.isfile(word) else word
            tree = yaml.safe_load(text)
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(tree, dict):
            keys |= set(_flatten(tree))
    return keys


def annotate(message: str, origin: dict[str, str]) -> str:
    """Name the verl key behind a spmdrl key in an error message from the parser or the checks."""
    for target, source in sorted(origin.items(), key=lambda kv: -len(kv[0])):
        if target in message and source not in message:
            return f"{message} (set by verl key {source})"
    return message
