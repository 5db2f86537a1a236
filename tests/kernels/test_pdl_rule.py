"""kernels/pdl.py's rule, checked in the source: every Triton kernel that takes ``USE_PDL`` calls ``pdl_enter`` exactly
once, as a statement of its own body (not inside a branch or loop). Each PDL kernel lets the next one be scheduled
before it waits, so order rests on every kernel waiting before it ends; a wait some programs could skip would let a
later kernel read a result still being written, which no CPU test and few GPU runs would catch."""

from __future__ import annotations

import ast

from tests.support.processes import ROOT


def _pdl_kernels() -> list[tuple[str, ast.FunctionDef]]:
    found = []
    for path in sorted((ROOT / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(a.arg == "USE_PDL" for a in node.args.args):
                found.append((f"{path.name}:{node.name}", node))
    return found


def _is_pdl_enter(stmt: ast.stmt) -> bool:
    call = stmt.value if isinstance(stmt, ast.Expr) else None
    return isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "pdl_enter"


def test_every_pdl_kernel_waits_unconditionally_once():
    kernels = _pdl_kernels()
    assert len(kernels) >= 20, [name for name, _ in kernels]  # the scan finds the kernels (26 when written)
    for name, fn in kernels:
        if name.startswith("pdl.py:"):
            continue  # pdl_enter itself
        top = [s for s in fn.body if _is_pdl_enter(s)]
        nested = [s for s in ast.walk(fn) if isinstance(s, ast.stmt) and _is_pdl_enter(s)]
        assert len(top) == 1 and len(nested) == 1, f"{name}: pdl_enter must be one statement of the kernel's body"
