"""Command line: parse the config (jsonargparse) and report bad input.

Every mistake a user can make in a config ends as one sentence naming the key,
the value and what is allowed, with exit code 2 and no traceback (unless
``--debug``), before any process group, model or data is touched: parsing
errors here, range and consistency errors in ``spmdrl.config.checks``.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import asdict
from typing import Optional, Sequence

import jsonargparse
import yaml
from jsonargparse import ActionConfigFile, ArgumentParser

from spmdrl.config.sections import Config
from spmdrl.errors import ConfigError


def build_parser(
    config_class: type = Config, prog: str = "python -m spmdrl.train",
    description: str = "spmdrl: GRPO/PPO post-training as one SPMD torchrun program. verl's key=value words "
    "and --verl-config FILE (a verl YAML) are accepted too and mapped onto these keys (docs/verl.md).",
    example: str = "configs/*.yaml",
) -> ArgumentParser:
    """The command line of ``config_class`` (the RL run's ``Config``, or ``SFTConfig``): ``--config FILE``,
    ``--debug`` and one ``--section.key`` per field, documented from the fields' docstrings."""
    jsonargparse.set_parsing_settings(docstring_parse_attribute_docstrings=True)
    parser = ArgumentParser(prog=prog, description=description, exit_on_error=False, default_env=False)
    parser.add_argument("--config", action=ActionConfigFile, help=f"YAML file of an experiment ({example}).")
    parser.add_argument("--debug", type=bool, default=False, help="Show tracebacks for configuration errors.")
    parser.add_class_arguments(config_class, nested_key=None)
    return parser


def _one_sentence(err: Exception) -> str:
    text = " ".join(str(err).split())
    text = re.sub(r"<class '(\w+)'>", r"\1", text)
    text = re.sub(r"Expected a typing\.Literal\[(.*?)\]", r"Expected one of \1", text)
    text = text.replace('Parser key "', 'config key "')
    return text


# Keys that were renamed: the old name still works, on the command line and in a --config file.
RENAMED = {"trainer.colocate": "trainer.sleep_rollout"}


def rename_keys(argv: Sequence[str], renamed: dict[str, str] = RENAMED) -> list[str]:
    """``argv`` with every renamed key under its new name: ``--old value``, ``--old=value``, and a
    ``--config`` file or YAML text that sets an old key (it then travels as YAML text); what does not read
    is left to the parser to report."""
    out: list[str] = []
    for i, word in enumerate(argv):
        for old, new in renamed.items():
            if word == f"--{old}" or word.startswith(f"--{old}="):
                word = f"--{new}" + word[len(old) + 2:]
        if i and argv[i - 1] == "--config":
            word = _renamed_yaml(word, renamed)
        elif word.startswith("--config="):
            word = "--config=" + _renamed_yaml(word[len("--config="):], renamed)
        out.append(word)
    return out


def _renamed_yaml(word: str, renamed: dict[str, str]) -> str:
    try:
        if os.path.isfile(word):
            with open(word) as f:
                tree = yaml.safe_load(f)
        else:
            tree = yaml.safe_load(word)
    except (OSError, yaml.YAMLError):
        return word
    changed = False
    for old, new in renamed.items():
        (section, key), (new_section, new_key) = old.split("."), new.split(".")
        if isinstance(tree, dict) and isinstance(tree.get(section), dict) and key in tree[section]:
            value = tree[section].pop(key)
            tree.setdefault(new_section, {}).setdefault(new_key, value)  # the new name wins where both are
            changed = True
    return yaml.safe_dump(tree, default_flow_style=True, width=1 << 30).strip() if changed else word


def parse_config(argv: Optional[Sequence[str]] = None) -> tuple[Config, bool]:
    """Parse argv into a ``Config``; returns (config, debug). Raises ConfigError on bad input."""
    from spmdrl.verl.args import annotate, rewrite_argv

    parser = build_parser()
    argv = rename_keys(list(argv) if argv is not None else sys.argv[1:])
    # verl's key=value words and --verl-config become one YAML --config, in precedence order.
    argv, verl_origin = rewrite_argv(argv)
    try:
        ns = parser.parse_args(argv)
    except jsonargparse.ArgumentError as err:
        raise ConfigError(annotate(_one_sentence(err), verl_origin)) from err
    debug = bool(ns.pop("debug", False))
    ns.pop("config", None)
    ns = parser.instantiate(ns)
    return Config(**{k: ns[k] for k in asdict(Config()).keys()}), debug


def exit_with(err: BaseException, debug: bool, prog: str = "spmdrl.train") -> None:
    """Print a user error as one line (or a traceback with --debug) and exit 2; ``prog`` starts the line."""
    if debug:
        raise err
    rank = os.environ.get("RANK")
    where = f" (rank {rank})" if rank not in (None, "0") else ""
    print(f"{prog}: error{where}: {err}", file=sys.stderr)
    sys.exit(2)
