"""Which modules import which: a program that only talks to a server loads neither torch nor transformers (the
remote clients, the command-line client and every protocol module import without them; ``LLM`` is imported only
when asked for), the ZMQ clients load no HTTP stack (fastapi is the HTTP front-end's alone, and it too runs without
torch or transformers), and the modules of kernels/ import each other in one direction (no circle, lazy imports
included)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest
import torch

from tests.support.processes import ROOT
from tests.support.timeouts import START_S

PROGRAM = """
import pkgutil, sys
import client
from client import Client, AsyncClient, SamplingParams, Completion, RequestError
import client.__main__
import protocol
for m in pkgutil.iter_modules(protocol.__path__):
    __import__("protocol." + m.name)
heavy = sorted(n for n in ("torch", "transformers", "coordinator.engine", "fastapi", "uvicorn") if n in sys.modules)
print("heavy:", heavy)
import openai_server.__main__
import openai_server.app
front_end = sorted(n for n in ("torch", "transformers", "coordinator.engine") if n in sys.modules)
print("front-end heavy:", front_end, "fastapi:", "fastapi" in sys.modules)
from nanoserve import LLM  # noqa: the lazy import still works, and it is the one that loads the engine
print("after LLM:", "coordinator.engine" in sys.modules)
"""


def test_remote_client_imports_without_torch():
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM], cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=START_S
    )
    assert out.returncode == 0, out.stderr
    assert "heavy: []" in out.stdout, out.stdout
    assert "front-end heavy: [] fastapi: True" in out.stdout, out.stdout
    assert "after LLM: True" in out.stdout, out.stdout


def _kernel_imports() -> dict[str, set[str]]:
    """kernels module -> the kernels modules it imports anywhere in its source (top level or inside functions)."""
    graph = {}
    for path in sorted((ROOT / "kernels").glob("*.py")):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kernels"):
                names = [node.module] if node.module != "kernels" else [f"kernels.{a.name}" for a in node.names]
                deps.update(names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("kernels."))
        graph[f"kernels.{path.stem}"] = deps
    return graph


def test_kernels_import_in_one_direction():
    graph = _kernel_imports()
    assert "kernels.triton_attention" in graph["kernels.backends"]  # the walk sees lazy imports

    def visit(module: str, path: list[str]) -> None:
        for dep in sorted(graph.get(module, ())):
            assert dep not in path, f"import circle: {' -> '.join(path + [dep])}"
            visit(dep, path + [dep])

    for module in graph:
        visit(module, [module])


def test_backend_selection_on_cpu():
    from kernels.attention import TorchAttentionBackend
    from kernels.backends import get_backend

    cpu = torch.device("cpu")
    assert isinstance(get_backend("auto", cpu), TorchAttentionBackend)
    assert isinstance(get_backend("torch", cpu), TorchAttentionBackend)
    assert get_backend("triton", cpu).name == "triton"  # runs on CPU tensors under TRITON_INTERPRET=1
    with pytest.raises(ValueError, match="unknown attention backend 'tpu'; choose one of auto, torch, triton, flash"):
        get_backend("tpu", cpu)
    with pytest.raises(ValueError, match="attention_backend 'flash' needs flash-attn"):
        get_backend("flash", cpu)


# Which folders each folder may import: its own layer and those below it. The front-ends (client/, openai_server/)
# reach the coordinator only over ZMQ, and workers never import the coordinator.
LAYERS = {
    "settings": set(),
    "protocol": {"settings"},
    "kernels": {"settings"},
    "comm": {"settings", "kernels"},
    "model": {"settings", "kernels", "comm"},
    "worker": {"settings", "protocol", "kernels", "comm", "model"},
    "coordinator": {"settings", "protocol", "model"},
    "client": {"settings", "protocol"},
    "openai_server": {"settings", "protocol", "client"},
    "nanoserve": {"settings", "protocol", "client", "coordinator", "openai_server"},
}


def _folder_imports(folder: str) -> dict[str, set[str]]:
    """file -> the project folders it imports from (top level or inside functions), other than its own."""
    found = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        tops = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                tops.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                tops.update(a.name.split(".")[0] for a in node.names)
        found[str(path.relative_to(ROOT))] = (tops & (set(LAYERS) | {"tests", "benchmarks", "training", "launch"})) - {
            folder
        }
    return found


def test_folders_import_only_downward():
    assert {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()} - {
        "tests",
        "benchmarks",
        "training",
    } == set(LAYERS)
    wrong = [
        f"{file} imports {sorted(tops - LAYERS[folder])}"
        for folder in LAYERS
        for file, tops in _folder_imports(folder).items()
        if tops - LAYERS[folder]
    ]
    assert not wrong, "imports from a higher layer or a sibling: " + "; ".join(wrong)
    assert "coordinator" in _folder_imports("nanoserve")["nanoserve/llm.py"]  # the walk sees the imports


def test_each_folder_says_which_process_runs_it():
    for folder in LAYERS:
        doc = ast.get_docstring(ast.parse((ROOT / folder / "__init__.py").read_text())) or ""
        assert "process" in doc or "lowest layer" in doc or "every process" in doc.lower(), folder
