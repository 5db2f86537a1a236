"""The first errors a newcomer meets, each one line through the real command: ``python -m client`` with no server
(exit 1, no traceback, within its --timeout); a --model that is missing or a file, named for what it is and refused
before torch is even imported (so before any worker could start), by launch.py and by ``nanoserve serve``; and
--tp past the CPU cores, served but warned about."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.support.nanoserve_command import imported_torch, nanoserve
from tests.support.processes import ROOT, free_port
from tests.support.timeouts import HANG_S, START_S

NO_TORCH = dict(os.environ, PYTHONPROFILEIMPORTTIME="1")


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not line.startswith("import time:")]


@pytest.mark.parametrize("timeout", ["60", "3"])
def test_client_without_a_server_is_one_line_and_exit_1(timeout):
    address = f"tcp://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "client", "--address", address, "--timeout", timeout, "hello"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        f"error: no server at {address} (connection refused); start one with: python launch.py"
    ]


def test_client_with_an_unanswering_address_is_one_line_within_its_timeout():
    # a reserved address nothing answers (packets dropped, or no route): ZMQ retries, the client gives up at --timeout
    address = "tcp://192.0.2.1:8765"
    cmd = [sys.executable, "-m", "client", "--address", address, "--timeout", "2", "hello"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 1 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and address in lines[0], out.stderr


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"not a directory")
    return path


@pytest.mark.parametrize("how", ["launch", "serve"])
@pytest.mark.parametrize("what", ["missing", "file", "tokenizer"])
def test_a_bad_model_path_is_named_at_once(how, what, tmp_path, a_file):
    missing = tmp_path / "no" / "such" / "dir"
    path = {"missing": missing, "file": a_file, "tokenizer": a_file}[what]
    flags = ["--tokenizer", str(path)] if what == "tokenizer" else ["--model", str(path)]
    if how == "launch":
        cmd = [sys.executable, str(ROOT / "launch.py"), *flags, "--port", "0"]
        out = subprocess.run(cmd, cwd=ROOT, env=NO_TORCH, capture_output=True, text=True, timeout=START_S)
        prog = "python launch.py"
    else:
        out = nanoserve("serve", *flags, "--port", "0", "--zmq-port", "0", env={"PYTHONPROFILEIMPORTTIME": "1"})
        prog = "nanoserve serve"
    assert out.returncode == 2 and out.stdout == ""
    line = _errors(out.stderr)[-1]
    name = "--tokenizer" if what == "tokenizer" else "--model"
    if what == "missing":
        assert line == (
            f"{prog}: error: argument {name}: {str(path)!r} does not exist (neither a model directory nor a Hugging "
            "Face Hub id such as Qwen/Qwen3-0.6B)"
        )
    else:
        assert line == (
            f"{prog}: error: argument {name}: {str(path)!r} is a file, not a model directory (a directory holding "
            "config.json and *.safetensors)"
        )
    assert not imported_torch(out.stderr), "refused only after torch was imported"


def test_a_hub_shaped_model_id_passes_the_path_check():
    from nanoserve.serve_args import model_path_problem

    for name in ("Qwen/Qwen3-0.6B", "gpt2", "some-org/tiny.v2"):
        assert model_path_problem(name) is None, name
    for name in ("./nope", "/abs/nope", "a/b/c", "../x", "~/nope"):
        assert "does not exist" in model_path_problem(name), name


@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset to limit the cores")
def test_tp_past_the_cpu_cores_warns_and_still_serves(tiny_tied):
    cmd = ["taskset", "-c", "0", sys.executable, str(ROOT / "launch.py"), "--model", str(tiny_tied), "--tp", "2"]
    cmd += ["--device", "cpu", "--dtype", "float32", "--max-model-len", "64", "--num-kv-blocks", "16"]
    cmd += ["--prompt", "hello", "--max-tokens", "3"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=START_S)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("Prompt: 'hello', Generated text: ")
    assert "--tp 2 on the CPU: 2 worker processes share 1 CPU core(s)" in out.stderr
