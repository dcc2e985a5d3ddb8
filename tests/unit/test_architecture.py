"""Rules of the code's shape that a machine checks: no import cycle, layers that import only downwards,
backends that import only their interface and shared helpers, a small package root, short functions.

Imports are read with ``ast`` from every spmdrl module, function-level and ``TYPE_CHECKING`` imports
included (a cycle through a lazy import is still a cycle a reader has to untangle).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "spmdrl"
MAX_ROOT_MODULES = 16
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = list(f.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The spmdrl module ``name`` refers to (an attribute of a module resolves to the module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> set[str]:
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            found |= {f"{base}.{a.name}" for a in node.names} | {base}
    owners = {_owner(n) for n in found if n.split(".")[0] == "spmdrl"}
    return {o for o in owners if o and o != module and o != "spmdrl"}


GRAPH = {m: _imports(m) for m in MODULES}


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    return out


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_no_import_cycles() -> None:
    assert _cycles() == []


def test_the_graph_sees_lazy_imports() -> None:
    # The engine registry imports its backends inside factory functions; the check must see those.
    assert "spmdrl.engines.fsdp2.engine" in GRAPH["spmdrl.engines"]
    assert "spmdrl.rollout.native.engine" in GRAPH["spmdrl.rollout"]


def test_algorithms_import_only_algorithms() -> None:
    """Pure functions: nothing from engines, rollout, rewards, the loop or the config."""
    bad = {m: sorted(d for d in deps if not _within(d, ("spmdrl.algos",)))
           for m, deps in GRAPH.items() if _within(m, ("spmdrl.algos",))}
    assert {m: d for m, d in bad.items() if d} == {}


# What every backend may import besides its own package: its interface and the shared helpers below the
# loop. Never another backend, the loop, experience, rewards or checkpoints' manager.
SHARED = ("spmdrl.batch", "spmdrl.precision", "spmdrl.parallel", "spmdrl.config", "spmdrl.errors",
          "spmdrl.cache")
BACKENDS = {
    "spmdrl.engines.fsdp2": ("spmdrl.engines.base", "spmdrl.engines.optim", "spmdrl.engines.logprobs",
                             "spmdrl.checkpoint.safe_load", "spmdrl.algos.registry"),
    # Megatron's config check reads a built-in model's shapes before the model is built (tp x pp must cut
    # it).
    "spmdrl.engines.megatron": ("spmdrl.engines.base", "spmdrl.engines.optim", "spmdrl.engines.logprobs",
                                "spmdrl.checkpoint.safe_load", "spmdrl.algos.registry",
                                "spmdrl.builtin.models"),
    # The native engine's config check reads a built-in model's architecture before it is built; hf_folder:
    # an MoE model's fused expert tensors under the per-expert checkpoint names its decoder loads.
    "spmdrl.rollout.native": ("spmdrl.rollout.base", "spmdrl.rollout.sampling",
                              "spmdrl.rollout.weight_store", "spmdrl.builtin.models",
                              "spmdrl.checkpoint.hf_folder"),
    "spmdrl.rollout.hf": ("spmdrl.rollout.base", "spmdrl.rollout.sampling", "spmdrl.rollout.weight_store"),
    # vllm_worker: what runs in vLLM's worker (its extension methods), imported there by name; flat: the
    # weights' byte buckets split placement's exchange uses too. The library engines, as the native one,
    # take an MoE model's experts under the checkpoint's names (checkpoint.hf_folder.per_expert).
    "spmdrl.rollout.vllm": ("spmdrl.rollout.base", "spmdrl.rollout.sampling", "spmdrl.rollout.vllm_worker",
                            "spmdrl.rollout.flat", "spmdrl.checkpoint.hf_folder"),
    # sglang_cpu is not imported by spmdrl: .venv-sglang's .pth file loads it in every SGLang process.
    "spmdrl.rollout.sglang": ("spmdrl.rollout.base", "spmdrl.rollout.sampling",
                              "spmdrl.checkpoint.hf_folder"),
}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_backends_import_only_their_interface_and_shared_helpers(backend: str) -> None:
    allowed = (backend, *BACKENDS[backend], *SHARED)
    bad = {m: sorted(d for d in deps if not _within(d, allowed))
           for m, deps in GRAPH.items() if _within(m, (backend,))}
    assert {m: d for m, d in bad.items() if d} == {}


def test_interfaces_do_not_import_backends() -> None:
    for interface in ("spmdrl.engines.base", "spmdrl.rollout.base", "spmdrl.rollout.session"):
        assert not any(_within(d, tuple(BACKENDS)) for d in GRAPH[interface]), interface


def test_package_root_is_small() -> None:
    root = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    assert len(root) <= MAX_ROOT_MODULES, root


def test_no_function_is_longer_than_80_lines() -> None:
    long = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{module}.{node.name}: {lines} lines")
    assert long == []
