"""Tools a policy may call mid-response, and the tool config that lists them (verl's YAML format).

    tools:
      - class_name: calculator                      # built-in name, pkg.module.Class or path/file.py:Class
        config: {type: native}                      # passed to the class as ``config``
        tool_schema:                                # OpenAI function schema, as the chat template shows it
          type: function
          function:
            name: calculator
            description: Evaluate an arithmetic expression.
            parameters:
              type: object
              properties: {expression: {type: string, description: "e.g. 12*(3+4)"}}
              required: [expression]

A tool is a class with four methods (``Tool``): ``create`` makes the state of one
trajectory (in the training process), ``execute`` runs one call with the parsed
arguments (in a sandboxed worker process, ``spmdrl.agent.runner``), ``calc_reward``
returns an optional reward contribution at the end of the trajectory, ``release``
frees what ``create`` made. The state travels to the worker and back as JSON, so it
must be plain data (dicts, lists, strings, numbers, booleans, None; at most 16 MiB
as JSON): a reply is never unpickled, and the trainer accepts nothing else from a
worker. ``execute`` returns a string; text in it that spells a special token of the
tokenizer (``<|im_end|>``) reaches the model as plain text.
"""

from __future__ import annotations

import abc
import ast
import importlib
import inspect
import math
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from spmdrl.sandbox.userfile import import_file


class Tool(abc.ABC):
    """Base class of a tool; a subclass overrides ``execute`` and, when it keeps state, the others."""

    def __init__(self, config: dict, tool_schema: dict) -> None:
        self.config = config
        self.tool_schema = tool_schema

    @property
    def name(self) -> str:
        return self.tool_schema["function"]["name"]

    def create(self, **kwargs: Any) -> dict:
        """State of one trajectory (``kwargs``: the row's ``extra_info["tools_kwargs"][name]``, when
        given); plain data (JSON-able), since it crosses to the worker and back."""
        return dict(kwargs)

    @abc.abstractmethod
    def execute(self, parameters: dict, state: dict) -> str:
        """The text the model sees for one call; may update ``state`` in place (plain data only). Runs in a
        sandboxed worker process (``rollout.multi_turn.sandbox``)."""

    def calc_reward(self, state: dict) -> float:
        """Reward this tool adds to its trajectory's score (default: none)."""
        return 0.0

    def release(self, state: dict) -> None:
        """Free what ``create`` made (default: nothing)."""


# --------------------------------------------------------------------------- calculator

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
# Bounds that keep one expression cheap: ``9**9**9`` would otherwise run for hours before any timeout fires.
MAX_DIGITS = 1000
MAX_EXPONENT = 10_000
MAX_NODES = 200


def _too_big_power(base: Any, exponent: Any) -> bool:
    """Whether ``base ** exponent`` surely has more than ``MAX_DIGITS`` digits, decided before computing it:
    ``(10**999)**10000`` would otherwise take seconds past the tool's timeout."""
    if not (isinstance(base, int) and isinstance(exponent, int)) or exponent <= 0 or abs(base) <= 1:
        return False
    return (abs(base).bit_length() - 1) * exponent > MAX_DIGITS * 3.33  # a lower bound of the result's bits


def safe_eval(expression: str) -> int | float:
    """Value of an arithmetic expression: numbers, + - * / // % **, unary signs and parentheses only.

    Parsed with ``ast`` and evaluated node by node (never ``eval``); names, calls, attributes and every
    other syntax raise ValueError, as do results over ``MAX_DIGITS`` digits and exponents over
    ``MAX_EXPONENT``.
    """
    if len(expression) > 2000:
        raise ValueError("expression is longer than 2000 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an arithmetic expression: {err.msg}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise ValueError(f"expression has more than {MAX_NODES} syntax nodes")

    def ev(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
            if isinstance(node.op, ast.Pow) and _too_big_power(left, right):
                raise ValueError(f"the result would have more than {MAX_DIGITS} digits")
            value = _BINARY[type(node.op)](left, right)
            if isinstance(value, complex):
                raise ValueError("result is complex")
            if isinstance(value, int) and value.bit_length() > MAX_DIGITS * 3.33:
                raise ValueError(f"the result would have more than {MAX_DIGITS} digits")
            return value
        raise ValueError(f"{type(node).__name__} is not allowed in an arithmetic expression")

    try:
        value = ev(tree.body)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:
        raise ValueError("result is too large") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("result is not finite")
    return value


class CalculatorTool(Tool):
    """``calculator(expression)``: the exact value of an arithmetic expression (integers stay exact)."""

    def execute(self, parameters: dict, state: dict) -> str:
        expression = parameters.get("expression")
        if not isinstance(expression, str):
            raise ValueError("argument 'expression' must be a string")
        value = safe_eval(expression)
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            value = int(value)
        return str(value)


CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses) exactly.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "for example 123456 * 789"}},
            "required": ["expression"],
        },
    },
}

# Built-in tools by short name (a tool config may also name pkg.module.Class or path/file.py:Class).
BUILTIN_TOOLS: dict[str, type[Tool]] = {"calculator": CalculatorTool}


# --------------------------------------------------------------------------- tool config


@dataclass
class ToolSpec:
    """One entry of the tool config: enough to rebuild the tool in a worker process."""

    class_name: str
    config: dict
    tool_schema: dict

    @property
    def name(self) -> str:
        return self.tool_schema["function"]["name"]

    def build(self) -> Tool:
        return load_tool_class(self.class_name)(self.config, self.tool_schema)


def load_tool_class(spec: str) -> type[Tool]:
    """A built-in name, ``pkg.module.Class`` or ``path/file.py:Class`` -> the class (ValueError otherwise)."""
    if spec in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[spec]
    path, sep, cls_name = spec.rpartition(":")
    if sep:
        try:
            module = import_file(Path(path).expanduser(), "tool", f"class_name={spec!r}")
        except (FileNotFoundError, ImportError) as err:  # as ValueError, like every tool config error
            raise ValueError(str(err)) from err
    else:
        module_name, _, cls_name = spec.rpartition(".")
        if not module_name:
            raise ValueError(f"tool class {spec!r} is not a built-in tool "
                             f"({', '.join(sorted(BUILTIN_TOOLS))}), a pkg.module.Class or a "
                             f"path/file.py:Class")
        try:
            module = importlib.import_module(module_name)
        except Exception as err:
            raise ValueError(f"tool class {spec!r}: importing module {module_name!r} failed: "
                             f"{err!r}") from err
    cls = getattr(module, cls_name, None)
    if not (isinstance(cls, type)
            and all(callable(getattr(cls, m, None)) for m in ("execute", "create", "release"))):
        raise ValueError(f"tool class {spec!r}: {cls_name!r} is not a class with create/execute/release "
                         f"methods")
    coroutines = [m for m in ("create", "execute", "calc_reward", "release")
                  if inspect.iscoroutinefunction(getattr(cls, m, None))]
    if coroutines:
        # verl's BaseTool keeps each trajectory's state inside the tool object, keyed by an instance id; here
        # a call runs in a worker process, so the state has to travel with it as a plain dict.
        raise ValueError(f"tool class {spec!r}: {cls_name!r} defines async {', '.join(coroutines)} (verl's "
                         f"BaseTool API); spmdrl expects a spmdrl.agent.tools.Tool with plain methods, "
                         f"execute(parameters, state) -> str, the trajectory's state passed in as a dict")
    if getattr(cls, "__abstractmethods__", None):
        raise ValueError(f"tool class {spec!r}: {cls_name!r} does not implement "
                         f"{', '.join(sorted(cls.__abstractmethods__))}")
    return cls


def _check_schema(schema: Any, where: str) -> None:
    """An OpenAI function schema: {type: function, function: {name, description?, parameters: object}}."""
    if (not isinstance(schema, dict) or schema.get("type") != "function"
            or not isinstance(schema.get("function"), dict)):
        raise ValueError(f"{where}.tool_schema must be a mapping with type: function and a function mapping")
    fn = schema["function"]
    if not isinstance(fn.get("name"), str) or not fn["name"].isidentifier():
        raise ValueError(f"{where}.tool_schema.function.name is {fn.get('name')!r}; it must be an identifier")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type") != "object":
        raise ValueError(f"{where}.tool_schema.function.parameters must be a JSON schema with type: object")
    props = params.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
        raise ValueError(f"{where}.tool_schema.function.parameters.properties must map names to schemas")
    required = params.get("required", [])
    if not isinstance(required, list) or any(r not in props for r in required):
        raise ValueError(f"{where}.tool_schema.function.parameters.required names {required!r}, "
                         f"which are not all in properties {sorted(props)}")


def load_tool_config(path: str | Path) -> list[ToolSpec]:
    """The tools listed in ``path`` (verl's tool_config YAML), each class imported once to check it exists.

    Raises ValueError with one sentence naming the file and the bad entry.
    """
    where = f"rollout.multi_turn.tool_config_path {str(path)!r}"
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{where} does not exist")
    try:
        doc = yaml.safe_load(file.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"{where} is not valid YAML{at}: {getattr(err, 'problem', None) or err}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("tools"), list) or not doc["tools"]:
        raise ValueError(f"{where} must be a mapping with a non-empty list under 'tools'")
    specs: list[ToolSpec] = []
    for i, entry in enumerate(doc["tools"]):
        at = f"{where}: tools[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise ValueError(f"{at} needs a class_name string")
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise ValueError(f"{at}.config must be a mapping")
        _check_schema(entry.get("tool_schema"), at)
        try:
            load_tool_class(entry["class_name"])
        except ValueError as err:
            raise ValueError(f"{at}: {err}") from None
        specs.append(ToolSpec(entry["class_name"], config, entry["tool_schema"]))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"{where} names a tool twice: {names}")
    return specs
