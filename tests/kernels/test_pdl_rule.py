"""kernels/pdl.py's rules, checked in the source. Every Triton kernel that takes ``USE_PDL`` calls ``pdl_enter``
exactly once, as a statement of its own body (not inside a branch or loop): each PDL kernel lets the next one be
scheduled before it waits, so order rests on every kernel waiting before it ends. And before that call a kernel
loads only parameters and step inputs. A wait some programs could skip, or an early read of a result, would let a
kernel read what is still being written, which no CPU test and few GPU runs would catch."""

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


# What a kernel may load before its wait: parameters (weights, norm weights, scales, biases, the rotary table) and
# step inputs copied in before the step's first kernel. A chain of early signals can start a kernel while any
# number of kernels in front still run, so anything a kernel of the step writes is read only after it.
READ_BEFORE_WAIT = {"w_ptr", "router_w_ptr", "norm_w_ptr", "ws_ptr", "bias_ptr", "wq_ptr", "wk_ptr", "cos_sin_ptr"}
READ_BEFORE_WAIT |= {"pos_ptr", "seq_lens_ptr"}
# moe_decode's down kernel reads the routing's expert ids early: gate/up, between them, signals after its wait.
EXCEPTIONS = {"moe_decode.py:_down_kernel": {"ids_ptr"}}


def _pointer_roots(node: ast.AST, derived: dict[str, set[str]]) -> set[str]:
    """The kernel arguments ending in ``_ptr`` an expression's addresses come from, through local assignments."""
    roots = set()
    for name in (n.id for n in ast.walk(node) if isinstance(n, ast.Name)):
        roots |= {name} if name.endswith("_ptr") else derived.get(name, set())
    return roots


def _loads_before_wait(fn: ast.FunctionDef) -> set[str]:
    derived: dict[str, set[str]] = {}
    roots: set[str] = set()
    for stmt in fn.body:
        if _is_pdl_enter(stmt):
            return roots
        for node in ast.walk(stmt):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "load" and node.args:
                roots |= _pointer_roots(node.args[0], derived)
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for name in (n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)):
                    derived[name] = derived.get(name, set()) | _pointer_roots(node.value, derived)
    return roots


def test_kernels_read_only_parameters_and_step_inputs_before_the_wait():
    kernels = {name: fn for name, fn in _pdl_kernels() if not name.startswith("pdl.py:")}
    early = {name: _loads_before_wait(fn) for name, fn in kernels.items()}
    for name, roots in early.items():
        unexpected = roots - READ_BEFORE_WAIT - EXCEPTIONS.get(name, set())
        assert not unexpected, f"{name} loads through {sorted(unexpected)} before pdl_enter"
    assert early["moe_decode.py:_down_kernel"] >= {"ids_ptr", "w_ptr"}  # the scan sees loads through locals
    enter = next(s.value for s in kernels["moe_decode.py:_gate_up_kernel"].body if _is_pdl_enter(s))
    late = [k for k in enter.keywords if k.arg == "SIGNAL_FIRST" and getattr(k.value, "value", None) is False]
    assert late, "the down kernel's early read of the expert ids needs gate/up to signal after its wait"
