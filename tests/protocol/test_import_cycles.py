"""No import cycle anywhere in the project's packages (the runtime folders, benchmarks/, top-level scripts), lazy
imports inside functions included; benchmarks never import tests/ (tests may import benchmarks, not the reverse)
and never reach into the runtime's private names (``from kernels.x import _y``, ``module._y``, ``obj._y``).
Read from the source with ``ast``, so nothing is imported or run."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.processes import ROOT

# attributes with a leading underscore that are public API (namedtuple's)
PUBLIC_UNDERSCORED = {"_replace", "_asdict", "_fields", "_make"}


def _modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every package at the top of ``root`` (tests/ aside) and every top-level
    script; a package's __init__.py is the package itself."""
    found = {p.stem: p for p in root.glob("*.py")}
    for pkg in sorted(p for p in root.iterdir() if (p / "__init__.py").exists() and p.name != "tests"):
        for path in pkg.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree``, ``if TYPE_CHECKING:`` blocks included: a circle of type hints is one a reader follows
    too (a helper module that needs its caller's type takes a mixin's ``self`` or a Protocol instead)."""
    return ast.walk(tree)


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement reads: ``from a import b`` names a.b (a submodule, or a name in a)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: from the package that holds ``module``
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join([*parts, *([node.module] if node.module else [])])
    return [f"{base}.{a.name}" for a in node.names]


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its source (top level or inside functions)."""
    modules = _modules(root)
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in _runtime_nodes(ast.parse(path.read_text())):
            for target in _imported(node, name, path.name == "__init__.py"):
                # the most specific project module the name reaches: a.b.c, else a.b, else a
                parts = target.split(".")
                hits = (".".join(parts[:n]) for n in range(len(parts), 0, -1))
                hit = next((m for m in hits if m in modules), None)
                if hit and hit != name:
                    deps.add(hit)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path that returns to its start) per strongly connected component of more than one module."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(_path_through(graph, set(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _path_through(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A cycle inside ``component``: from its first module, breadth first back to it."""
    start = min(component)
    prev, frontier = {}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(component)


def test_the_walk_sees_lazy_and_relative_imports():
    graph = import_graph()
    assert "kernels.triton_attention" in graph["kernels.backends"]  # inside a function
    assert "benchmarks.hf_peer" in graph["benchmarks.throughput"]  # inside a function
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_anywhere():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def _benchmark_files() -> list[Path]:
    return sorted((ROOT / "benchmarks").rglob("*.py"))


def test_benchmarks_never_import_tests():
    graph = import_graph()
    assert not any(m.startswith("tests") for deps in graph.values() for m in deps)  # tests/ is not in the graph
    wrong = []
    for path in _benchmark_files():
        for node in _runtime_nodes(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            wrong += [
                f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names if n.split(".")[0] == "tests"
            ]
    assert not wrong, "; ".join(wrong)


def test_benchmarks_use_only_public_names_of_the_runtime():
    modules = _modules(ROOT)
    wrong = []
    for path in _benchmark_files():
        tree = ast.parse(path.read_text())
        third_party = set()  # names bound to modules outside the project (torch._scaled_mm is torch's business)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] not in modules:
                third_party.update(a.asname or a.name for a in node.names)
            elif isinstance(node, ast.Import):
                third_party.update(
                    (a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] not in modules
                )
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in modules:
                wrong += [f"{where} imports {a.name}" for a in node.names if a.name.startswith("_")]
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                owner = root.id if isinstance(root, ast.Name) else None
                if node.attr not in PUBLIC_UNDERSCORED and owner not in {"self", "cls", *third_party}:
                    wrong.append(f"{where} reads {ast.unparse(node)}")
    assert not wrong, "benchmarks reaching into private names: " + "; ".join(wrong)
