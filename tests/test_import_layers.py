"""The package's import graph: no circles among genolong's modules, and no import upwards from
genolong.parallel into genolong.train.

Every import counts, at module level or deferred inside a function (a deferred import still ties
the two modules together; it only hides the circle from the interpreter), except those under
`if TYPE_CHECKING:`. A package's `__init__` is not counted as imported by its submodules.

`python tests/test_import_layers.py` prints the circles and the back-edges found.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Circles accepted for now (sets of module names), each with the reason beside it; none today.
TOLERATED: list[set[str]] = []


def modules(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """{dotted name: (path, is a package)} for every module under root/genolong."""
    found = {}
    for path in sorted((root / "genolong").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


def _imports(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in body:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _imports(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                yield from _imports([child])
            elif isinstance(child, ast.excepthandler):
                yield from _imports(child.body)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """{module: the genolong modules it imports}."""
    mods = modules(root)
    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, (path, package) in mods.items():
        for node in _imports(ast.parse(path.read_text(encoding="utf-8")).body):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    here = name.split(".") if package else name.split(".")[:-1]
                    here = here[: len(here) - (node.level - 1)]
                    base = ".".join(here + ([base] if base else []))
                # `from pkg import sub` imports the submodule; `from mod import name` the module.
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base for alias in node.names]
            for target in targets:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def back_edges(graph: dict[str, set[str]], lower: str = "genolong.parallel", upper: str = "genolong.train") -> list[tuple[str, str]]:
    return sorted((a, b) for a, deps in graph.items() for b in deps if _within(a, lower) and _within(b, upper))


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_finder_sees_a_circle_through_a_deferred_import(tmp_path):
    pkg = tmp_path / "genolong"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from genolong.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .c import g\n    return g\n")
    (pkg / "sub" / "c.py").write_text("import genolong.sub.a\n")
    (pkg / "sub" / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from genolong.sub import e\n")
    (pkg / "sub" / "e.py").write_text("from genolong.sub.d import x\n")
    graph = import_graph(tmp_path)
    assert circles(graph) == [{"genolong.sub.a", "genolong.sub.b", "genolong.sub.c"}]
    assert graph["genolong.sub.d"] == set()  # an import for type checking only is not an edge


def test_no_import_circles_in_genolong():
    found = [sorted(c) for c in circles(import_graph()) if c not in TOLERATED]
    assert found == [], f"import circles (move the shared part into a module both import): {found}"


def test_parallel_does_not_import_train():
    assert back_edges(import_graph()) == [], "genolong.parallel must not import genolong.train (train applies parallel)"


if __name__ == "__main__":
    graph = import_graph()
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} edges")
    for circle in circles(graph):
        print(f"circle of {len(circle)}: {', '.join(sorted(circle))}")
    for a, b in back_edges(graph):
        print(f"back-edge: {a} -> {b}")
