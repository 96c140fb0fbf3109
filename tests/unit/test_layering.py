"""The layers of docs/architecture.md, checked against the code's imports.

A request flows one way: client → tokenizer → scheduler → worker → tokenizer → client, with the
cache and constrained decoding as libraries. Every `import` of every module counts (those inside
functions too), read from the source; an import under `if TYPE_CHECKING:` counts for the layer
rules (a type named across a boundary is a dependency on it) but not for cycles (it never runs).
"""

from __future__ import annotations

import ast
import pathlib
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _modules() -> dict[str, pathlib.Path]:
    """Module name -> file, from pyproject's package-dir map (folders named as their packages)."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    mods = {}
    for package, folder in package_dir.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join([package, *parts])] = path
    return mods


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str, path: pathlib.Path) -> tuple[set[str], set[str]]:
    """(every module of ours `name` imports, those imported at run time: not only for type checking)."""
    every, runs = set(), set()
    is_package = path.name == "__init__.py"

    def targets(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        base = node.module or ""
        if node.level:
            here = name.split(".") if is_package else name.split(".")[:-1]
            here = here[: len(here) - node.level + 1]
            base = ".".join(here + ([node.module] if node.module else []))
        # `from package import module` imports the module; `from module import name` the module
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]

    def visit(node: ast.AST, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for t in targets(child):
                    if t in MODULES and t != name:
                        every.add(t)
                        if not type_only:
                            runs.add(t)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), True)
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), type_only)
            else:
                visit(child, type_only)

    visit(ast.parse(path.read_text()), False)
    return every, runs


GRAPH: dict[str, set[str]] = {}
RUNTIME_GRAPH: dict[str, set[str]] = {}
for _name, _path in MODULES.items():
    GRAPH[_name], RUNTIME_GRAPH[_name] = _imports(_name, _path)


def _reach(start: str, graph: dict[str, set[str]]) -> dict[str, str]:
    """Every module `start` imports, directly or through others: module -> the module that imports it."""
    via, todo = {}, [start]
    while todo:
        here = todo.pop()
        for t in graph[here]:
            if t not in via and t != start:
                via[t] = here
                todo.append(t)
    return via


def _chain(start: str, end: str, via: dict[str, str]) -> str:
    path = [end]
    while path[-1] != start:
        path.append(via[path[-1]])
    return " -> ".join(reversed(path))


R = "radixlm.runtime"
# (modules under this prefix, may not reach modules under these prefixes directly or through
# others, except these)
RULES = [
    (f"{R}.tokenizer", [f"{R}.worker", f"{R}.scheduler", f"{R}.launch", f"{R}.engine", f"{R}.local_engine"], []),
    (f"{R}.server", [f"{R}.worker", f"{R}.scheduler", f"{R}.launch", f"{R}.engine", f"{R}.local_engine"], []),
    (f"{R}.router", [f"{R}.worker", f"{R}.scheduler", f"{R}.tokenizer", f"{R}.server.http_server"], []),
    (f"{R}.worker", [f"{R}.scheduler", f"{R}.constrained", f"{R}.tokenizer", f"{R}.server"], []),
    (f"{R}.constrained", [f"{R}.worker", f"{R}.scheduler", f"{R}.tokenizer", f"{R}.server"], []),
    (f"{R}.cache", [f"{R}.worker", f"{R}.scheduler", f"{R}.constrained", f"{R}.tokenizer", f"{R}.server"], []),
    # the scheduler loads the tokenizer (stop strings, grammar vocabularies), nothing else of tokenizer/
    (f"{R}.scheduler", [f"{R}.tokenizer", f"{R}.server", f"{R}.launch"], [f"{R}.tokenizer.loader"]),
    # leaves: the model families' table needs nothing of the runtime, the model's identity nothing but it
    (f"{R}.families", [R + "."], []),
    (f"{R}.model_config", [R + "."], [f"{R}.families"]),
    ("radixlm.kernels", [R], []),
]


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix if prefix.endswith(".") else prefix + ".")


@pytest.mark.parametrize("layer,forbidden,allowed", RULES, ids=[r[0].removeprefix("radixlm.") for r in RULES])
def test_layer_imports_only_what_it_may(layer, forbidden, allowed):
    broken = []
    for name in sorted(m for m in MODULES if _under(m, layer)):
        via = _reach(name, GRAPH)
        for target in sorted(via):
            if (any(_under(target, f) for f in forbidden) and not _under(target, layer)
                    and not any(_under(target, a) for a in allowed)):
                broken.append(_chain(name, target, via))
    assert not broken, "imports against the layers:\n" + "\n".join(broken)


def test_no_import_cycles():
    cycles = {}
    for name in MODULES:
        via = _reach(name, RUNTIME_GRAPH)
        back = next((m for m in [name, *via] if name in RUNTIME_GRAPH[m]), None)
        if back is not None:  # name reaches a module that imports name
            loop = (_chain(name, back, via) if back != name else name) + " -> " + name
            cycles.setdefault(frozenset(loop.split(" -> ")), loop)
    assert not cycles, "import cycles:\n" + "\n".join(sorted(cycles.values()))


def test_the_checker_sees_imports():
    """The graph is read right: known imports of each kind appear (a checker that read nothing
    would pass every rule above)."""
    assert f"{R}.worker.model_worker" in GRAPH[f"{R}.scheduler.scheduler"]  # module level
    assert f"{R}.server.http_server" in GRAPH[f"{R}.launch"]  # inside a function
    assert f"{R}.ipc" in GRAPH[f"{R}.client"]  # `from package import module`
    assert "radixlm.kernels.common" in GRAPH["radixlm.kernels.decode_attention"]
    forward = f"{R}.worker.forward_batch"
    assert f"{R}.cache.kv_pool" in GRAPH[forward] - RUNTIME_GRAPH[forward]  # under TYPE_CHECKING


def test_the_cycle_check_finds_a_cycle(monkeypatch):
    monkeypatch.setitem(RUNTIME_GRAPH, f"{R}.messages", RUNTIME_GRAPH[f"{R}.messages"] | {f"{R}.ipc"})
    with pytest.raises(AssertionError, match="ipc"):
        test_no_import_cycles()


def test_a_layer_rule_finds_a_crossing(monkeypatch):
    monkeypatch.setitem(GRAPH, f"{R}.sampling_params", GRAPH[f"{R}.sampling_params"] | {f"{R}.worker.sampler"})
    with pytest.raises(AssertionError, match=r"tokenizer\.manager -> .*sampling_params -> .*worker\.sampler"):
        test_layer_imports_only_what_it_may(f"{R}.tokenizer", [f"{R}.worker"], [])
