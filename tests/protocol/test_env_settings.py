"""settings/env.py: every NANOSERVE_* variable read when the code that uses it runs (never at import), every one in
the README's environment table, and no setting left that nothing reads (a retired switch's remains)."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

from settings.env import PREFIX, Settings

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ("settings", "protocol", "kernels", "comm", "model", "worker", "coordinator", "client", "openai_server")
RUNTIME += ("nanoserve", "launch.py")


def import_time_reads(path: Path) -> list[int]:
    """Lines of ``path`` that call settings() outside any function: at import, before a launcher's or a test's
    environment applies."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.Call) and not in_function:
            f = node.func
            if (isinstance(f, ast.Name) and f.id == "settings") or (
                isinstance(f, ast.Attribute) and f.attr == "settings"
            ):
                found.append(node.lineno)
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def runtime_files(root: Path = ROOT) -> list[Path]:
    return [
        f for name in RUNTIME for f in ([root / name] if name.endswith(".py") else sorted((root / name).rglob("*.py")))
    ]


def test_settings_are_read_at_call_time_not_at_import():
    reads = {str(f.relative_to(ROOT)): lines for f in runtime_files() if (lines := import_time_reads(f))}
    assert not reads, f"settings() called at import time (read it where it is used): {reads}"


def variables_read(root: Path = ROOT) -> set[str]:
    """Every NANOSERVE_* variable the code reads: settings/env.py's, and the tests' own timeout scale."""
    env = (root / "settings" / "env.py").read_text()
    names = {PREFIX + n for n in re.findall(r'_(?:switch|flag|text)\("([A-Z0-9_]+)"\)', env)}
    return names | set(
        re.findall(r'"(NANOSERVE_[A-Z0-9_]+)"', (root / "tests" / "support" / "timeouts.py").read_text())
    )


def readme_table(root: Path = ROOT) -> set[str]:
    return set(re.findall(r"^\| `(NANOSERVE_[A-Z0-9_]+)` \|", (root / "README.md").read_text(), re.M))


def test_every_variable_read_is_in_the_readme_table_and_no_other():
    read, documented = variables_read(), readme_table()
    assert read - documented == set(), "read but not in README.md's environment table"
    assert documented - read == set(), "in README.md's environment table but read nowhere"


def test_every_setting_is_used_outside_settings():
    """A Settings field nothing reads is a retired switch left behind (imports of a same-named module aside)."""
    readers = runtime_files() + sorted((ROOT / "benchmarks").rglob("*.py"))  # NANOSERVE_CACHE: the benchmarks'
    lines = [
        line
        for f in readers
        if f.relative_to(ROOT).parts[0] != "settings"
        for line in f.read_text().splitlines()
        if not line.lstrip().startswith(("from ", "import "))
    ]
    code = "\n".join(lines)
    fields = [f.name for f in dataclasses.fields(Settings) if f.name != "triton_interpret"]
    unused = [name for name in fields if not re.search(rf"\.{name}\b(?![./])", code)]
    assert not unused, f"settings nothing reads: {unused}"
