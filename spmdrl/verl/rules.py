"""The rows of spmdrl's verl tables (``spmdrl.verl.compat`` for RL, ``spmdrl.verl.sft`` for SFT): what a row
is, its three kinds (``m`` maps, ``ignore`` accepts with no effect, ``only`` accepts the values spmdrl always
behaves as), and the leaf keys of spmdrl's config a row may set."""

from __future__ import annotations

import functools
import typing
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Callable, Optional

from spmdrl.errors import ConfigError

SKIP = object()  # a converter's "this value sets nothing" (e.g. verl's null meaning "use the default")


@dataclass(frozen=True)
class Ctx:
    """What a converter may look at besides its own value."""

    world_size: int
    verl: dict[str, Any]  # every verl key of the run (defaults, file, command line), flattened
    given: frozenset[str] = frozenset()  # spmdrl keys a --config file sets (a verl default never overrides)


@dataclass(frozen=True)
class Rule:
    verl: str  # dotted verl key; "prefix.*" matches a whole subtree
    spmdrl: str  # spmdrl key(s) it sets, for the docs; "" when it sets nothing
    convert: Callable[[Any, Ctx], dict[str, Any]]  # value -> {spmdrl key: value}; {} sets nothing
    note: str = ""
    ignored: bool = False  # accepted and reported in the info line

    def matches(self, key: str) -> bool:
        if self.verl.endswith(".*"):
            return key.startswith(self.verl[:-1])
        return key == self.verl


def m(verl: str, spmdrl: str, conv: Optional[Callable[[Any], Any]] = None, note: str = "") -> Rule:
    """verl key -> one spmdrl key, the value converted by ``conv`` (which may return SKIP)."""

    def convert(value: Any, ctx: Ctx) -> dict[str, Any]:
        if value is None and not _nullable(spmdrl):
            return {}  # verl's null for a setting spmdrl always has ("not set"): spmdrl's default stands
        out = conv(value) if conv is not None else value
        return {} if out is SKIP else {spmdrl: out}

    return Rule(verl, spmdrl, convert, note)


def ignore(verl: str, why: str) -> Rule:
    return Rule(verl, "", lambda v, ctx: {}, why, ignored=True)


def only(verl: str, allowed: tuple, why: str) -> Rule:
    """Accepted when the value is one spmdrl always behaves as; any other value stops the run."""

    def convert(value: Any, ctx: Ctx) -> dict[str, Any]:
        if value not in allowed:
            shown = " or ".join(repr(a) for a in allowed)
            raise ConfigError(f"verl key {verl}={value!r} is not supported: spmdrl accepts only {shown} "
                              f"({why})")
        return {}

    return Rule(verl, "", convert, f"only {', '.join(repr(a) for a in allowed)}: {why}")


# ----------------------------------------------------------------------------- spmdrl keys


@functools.lru_cache(maxsize=4)
def spmdrl_fields(config_cls: Optional[type] = None) -> dict[str, Any]:
    """Every leaf key of spmdrl's Config (or of ``config_cls``: the SFT config), dotted, with its type (the
    tests check each table target)."""
    from spmdrl.config import Config

    def walk(obj: Any, prefix: str) -> dict[str, Any]:
        hints = typing.get_type_hints(type(obj))
        out: dict[str, Any] = {}
        for f in fields(obj):
            value = getattr(obj, f.name)
            leaf = {prefix + f.name: hints[f.name]}
            out.update(walk(value, f"{prefix}{f.name}.") if is_dataclass(value) else leaf)
        return out

    return walk((config_cls or Config)(), "")


def spmdrl_keys(config_cls: Optional[type] = None) -> set[str]:
    return set(spmdrl_fields(config_cls))


def _nullable(key: str) -> bool:
    return type(None) in typing.get_args(spmdrl_fields().get(key))
