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


def parse_config(argv: Optional[Sequence[str]] = None) -> tuple[Config, bool]:
    """Parse argv into a ``Config``; returns (config, debug). Raises ConfigError on bad input."""
    from spmdrl.verl.args import annotate, rewrite_argv

    parser = build_parser()
    # verl's key=value words and --verl-config become one YAML --config, in precedence order.
    argv, verl_origin = rewrite_argv(list(argv) if argv is not None else sys.argv[1:])
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
