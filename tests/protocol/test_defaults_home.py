"""settings/defaults.py is the one home of the numbers and names several processes share: none of them is written
as a literal anywhere else in the runtime folders, and WorkerConfig is derived from EngineConfig by field name."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from coordinator.config import EngineConfig
from protocol.messages import WorkerConfig
from settings import defaults

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = (
    "settings",
    "protocol",
    "kernels",
    "comm",
    "model",
    "worker",
    "coordinator",
    "client",
    "openai_server",
    "nanoserve",
    "launch.py",
)
# parameters and flags whose default is a shared one: the default must be a name, never a literal
SHARED_NAMES = {
    "host",
    "port",
    "zmq_port",
    "address",
    "max_pending_requests",
    "max_message_bytes",
    "log_stats_interval",
}
# flags whose default is SamplingParams' own (the CLIs share them by reading the record, not by repeating it)
SAMPLING_FLAGS = {"max_tokens", "temperature", "top_p", "top_k", "min_p"}
WORKER_ONLY = {"max_model_len", "dist_init_method", "draft_model"}  # derived by the engine


def _constant(node: ast.AST) -> object:
    """The value of a literal, or of an expression of literals (8 << 20), else a sentinel."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    if isinstance(node, ast.BinOp):
        left, right = _constant(node.left), _constant(node.right)
        if isinstance(left, int) and isinstance(right, int):
            ops = {ast.LShift: lambda a, b: a << b, ast.Mult: lambda a, b: a * b}
            if type(node.op) in ops:
                return ops[type(node.op)](left, right)
    return _constant


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes (usage examples may name the default address)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _flag_name(call: ast.Call) -> str | None:
    """``add_argument("--max-pending-requests", ...)``'s dest-like name, for an add_argument call."""
    if not (isinstance(call.func, ast.Attribute) and call.func.attr == "add_argument"):
        return None
    flags = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return flags[0].lstrip("-").replace("-", "_") if flags else None


def _is_literal(node: ast.AST | None) -> bool:
    """A default written as a value (None and "" say "unset", not a value)."""
    return node is not None and _constant(node) not in (_constant, None, "")


def default_literals(path: Path) -> list[str]:
    """Each place in ``path`` that writes a shared default as a literal: 'line: what'."""
    tree = ast.parse(path.read_text(), str(path))
    docs = _docstrings(tree)
    found = []  # 4096 alone is also K of a GEMM: the pending limit is caught by its name
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and id(node) not in docs:
            if isinstance(node.value, str) and f":{defaults.ZMQ_PORT}" in node.value:
                found.append(f"{node.lineno}: the ZMQ address {node.value!r}")
            elif type(node.value) is int and node.value == defaults.ZMQ_PORT:
                found.append(f"{node.lineno}: the ZMQ port {node.value}")
        elif isinstance(node, ast.BinOp) and _constant(node) == defaults.MAX_MESSAGE_BYTES:
            found.append(f"{node.lineno}: the message limit {ast.unparse(node)}")
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            names = {e.value for e in node.elts if isinstance(e, ast.Constant)}
            if {"torch", "triton", "flash"} <= names:
                found.append(f"{node.lineno}: the attention backend names")
            elif len(names & set(defaults.DTYPE_ALIASES)) >= 2:
                found.append(f"{node.lineno}: dtype aliases")
        elif isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
            if len(keys & set(defaults.DTYPE_ALIASES)) >= 2:
                found.append(f"{node.lineno}: dtype aliases")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.posonlyargs + node.args.args
            pairs = list(zip(args[len(args) - len(node.args.defaults) :], node.args.defaults))
            pairs += [(a, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d is not None]
            for arg, default in pairs:
                if arg.arg in SHARED_NAMES and _is_literal(default):
                    found.append(f"{node.lineno}: {node.name}({arg.arg}={ast.unparse(default)})")
        elif isinstance(node, ast.Call) and (name := _flag_name(node)) in SHARED_NAMES | SAMPLING_FLAGS:
            default = next((k.value for k in node.keywords if k.arg == "default"), None)
            if _is_literal(default):
                found.append(f"{node.lineno}: --{name.replace('_', '-')} default={ast.unparse(default)}")
    return found


def runtime_files(root: Path = ROOT) -> list[Path]:
    files = []
    for name in RUNTIME:
        path = root / name
        files += [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))
    return [f for f in files if f.resolve() != (root / "settings" / "defaults.py").resolve()]


def test_shared_defaults_are_written_only_in_their_home():
    problems = {str(f.relative_to(ROOT)): p for f in runtime_files() if (p := default_literals(f))}
    assert not problems, f"shared defaults written as literals outside settings/defaults.py: {problems}"


@pytest.mark.parametrize(
    "source, what",
    [
        ("def serve(port: int = 8765): ...", "the ZMQ port"),
        ('ADDRESS = "tcp://127.0.0.1:8765"', "the ZMQ address"),
        ("LIMIT = 8 << 20", "the message limit"),
        ("class S:\n    def __init__(self, max_pending_requests=4096): ...", "max_pending_requests=4096"),
        ('p.add_argument("--max-message-bytes", type=int, default=1 << 23)', "--max-message-bytes default"),
        ('p.add_argument("--temperature", type=float, default=0.0)', "--temperature default"),
        ('BACKENDS = ("auto", "torch", "triton", "flash")', "attention backend names"),
        ('ALIASES = {"bf16": "bfloat16", "fp16": "float16"}', "dtype aliases"),
        ('DTYPES = ("auto", "bfloat16", "bf16", "fp16")', "dtype aliases"),
    ],
)
def test_the_scan_finds_each_kind_of_copy(tmp_path, source, what):
    path = tmp_path / "copy.py"
    path.write_text(f'"""Usage: connect to tcp://127.0.0.1:8765 (a docstring may say it)."""\n{source}\n')
    found = default_literals(path)
    assert any(what in f for f in found), found


def test_worker_config_is_derived_from_engine_config_by_field_name(tmp_path):
    """Every WorkerConfig field is an EngineConfig field of the same type, or one the engine derives; and
    worker_config carries each engine value over by name."""
    engine = {f.name: f for f in dataclasses.fields(EngineConfig)}
    for f in dataclasses.fields(WorkerConfig):
        if f.name in WORKER_ONLY or f.name == "num_kv_blocks":
            continue
        assert f.name in engine, f"WorkerConfig.{f.name} has no EngineConfig field of that name"
        assert str(f.type) == str(engine[f.name].type), (f.name, f.type, engine[f.name].type)
    cfg = EngineConfig(
        model=str(tmp_path),
        device="cpu",
        dtype="bf16",
        block_size=32,
        max_num_seqs=7,
        seed=5,
        attention_backend="torch",
    )
    wc = cfg.worker_config(123)
    for f in dataclasses.fields(WorkerConfig):
        if f.name not in WORKER_ONLY and f.name != "num_kv_blocks":
            assert getattr(wc, f.name) == getattr(cfg, f.name), f.name
    assert (wc.max_model_len, wc.num_kv_blocks, wc.dist_init_method) == (123, -1, "")
    assert EngineConfig(device="cpu", num_kv_blocks=9).worker_config(1).num_kv_blocks == 9
