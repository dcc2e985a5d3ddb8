r"""Every ``.py`` file the documentation names exists, and the map (docs/layout.md) lists every module.

Where paths are read: README.md, docs/*.md and pyproject.toml (the whole text), the comments and string
literals (docstrings included) of the package's Python files, and the package's C++ sources.

A path is a token of ``[\w.-]`` names joined by ``/`` that ends in ``.py``, read after URLs are removed;
a token right after ``/``, ``<`` or ``$`` is the tail of a pattern (``engines/<backend>/checkpoint.py``)
and is not read. A path with a ``/`` must exist relative to the naming file's folder, a folder above it
(up to the repository root) or ``spmdrl/``; one that does not and starts with another project's top
folder (FOREIGN: ``verl/``, ``torchtitan/``, ``examples/``, ...) quotes that project on purpose and is
skipped. A bare name must be the name of a file in the repository's root, ``spmdrl/``, ``tests/`` or
``bench/``. EXAMPLES are the names that stand for a user's own file.

The map is the code block of docs/layout.md: a line that starts with a folder (``spmdrl/engines/``)
opens that folder's entry and the indented lines below continue it. Each module of the package (every
spmdrl/**/*.py but ``__init__.py``) must be named as ``name.py`` in its own folder's entry, and every
path an entry names must exist relative to that folder.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "spmdrl"
LAYOUT = ROOT / "docs" / "layout.md"

PATH = re.compile(r"(?<![\w./<>$-])(?:\.\.?/)*\w[\w.-]*(?:/[\w.-]+)*\.py\b")
URL = re.compile(r"\w+://\S+")
FOREIGN = ("verl", "torchtitan", "torchtune", "trl", "vllm", "sglang", "megatron", "slime", "nanochat",
           "transformers", "torch", "torchvision", "recipe", "examples", "scripts")
# Stand-ins for the user's own file in examples and help texts.
EXAMPLES = {"path/to/file.py", "path/file.py", "path.py", "file.py", "my_reward.py"}
# Python 3.12 splits an f-string into tokens of its own; its text parts are FSTRING_MIDDLE.
_STRINGS = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}


def _named_files() -> set[str]:
    files = {p.name for p in ROOT.glob("*.py")}
    for folder in ("spmdrl", "tests", "bench"):
        files |= {p.name for p in (ROOT / folder).rglob("*.py")}
    return files


FILES = _named_files()


def _python_text(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each comment and string literal."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type in _STRINGS:
            out += [(tok.start[0] + i, line) for i, line in enumerate(tok.string.splitlines())]
    return out


def _sources() -> dict[Path, list[tuple[int, str]]]:
    plain = [ROOT / "README.md", ROOT / "pyproject.toml", *sorted((ROOT / "docs").glob("*.md")),
             *sorted(PACKAGE.rglob("*.cpp"))]
    out = {p: list(enumerate(p.read_text().splitlines(), 1)) for p in plain}
    out.update({p: _python_text(p) for p in sorted(PACKAGE.rglob("*.py"))})
    return out


def _resolves(path: Path, name: str) -> bool:
    if "/" not in name:
        return name in FILES
    bases = [path.parent, *(p for p in path.parent.parents if p == ROOT or ROOT in p.parents), PACKAGE]
    return any((base / name).exists() for base in bases)


def _missing(path: Path, lines: list[tuple[int, str]]) -> list[str]:
    out = []
    for number, line in lines:
        for name in PATH.findall(URL.sub(" ", line)):
            if name in EXAMPLES or _resolves(path, name):
                continue
            if "/" in name and name.split("/")[0] in FOREIGN:
                continue
            out.append(f"{path.relative_to(ROOT)}:{number}: {name}")
    return out


def test_every_named_py_file_exists() -> None:
    missing = [m for path, lines in _sources().items() for m in _missing(path, lines)]
    assert missing == []


def _map_entries() -> dict[str, str]:
    """docs/layout.md's code block as folder -> the text of its entry."""
    block = LAYOUT.read_text().split("```\n")[1]
    entries: dict[str, str] = {}
    folder = None
    for line in block.splitlines():
        if line and not line[0].isspace():
            folder, _, line = line.partition(" ")
            entries.setdefault(folder, "")
        if folder is not None:
            entries[folder] += " " + line
    return entries


def test_the_map_lists_every_module() -> None:
    entries = _map_entries()
    unlisted = []
    for module in sorted(PACKAGE.rglob("*.py")):
        if module.name == "__init__.py":
            continue
        folder = module.parent.relative_to(ROOT).as_posix() + "/"
        if module.name not in PATH.findall(entries.get(folder, "")):
            unlisted.append(module.relative_to(ROOT).as_posix())
    assert unlisted == []


def test_every_path_in_the_map_exists() -> None:
    missing = [f"{folder}{name}" for folder, text in _map_entries().items()
               for name in PATH.findall(text) if not (ROOT / folder / name).exists()]
    assert missing == []


def test_the_checks_catch_what_they_are_for() -> None:
    page = ROOT / "docs" / "design.md"
    assert _missing(page, [(1, "see spmdrl/rollout/native_model.py and native_kernels.py")]) == [
        "docs/design.md:1: spmdrl/rollout/native_model.py", "docs/design.md:1: native_kernels.py"]
    assert _missing(page, [(1, "verl's verl/trainer/ppo/core_algos.py, https://x.org/a/b.py, "
                               "engines/<backend>/checkpoint.py, ../bench/async.py, engines/base.py")]) == []
    assert "spmdrl/" in _map_entries() and "spmdrl/engines/fsdp2/" in _map_entries()
