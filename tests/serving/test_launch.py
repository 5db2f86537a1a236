"""``python launch.py``: offline --prompt mode, flags generated from EngineConfig, argument and start-up errors."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from coordinator.config import EngineConfig
from tests.support.processes import ROOT

LAUNCH = [sys.executable, str(ROOT / "launch.py")]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*LAUNCH, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_prompt_prints_completions_and_exits(tiny_tied):
    from nanoserve import LLM, SamplingParams

    out = run(
        "--prompt", "hello", "def foo(", "--model", str(tiny_tied), "--device", "cpu", "--dtype", "float32",
        "--max-model-len", "128", "--num-kv-blocks", "32", "--max-tokens", "12", "--temperature", "0",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2
    with LLM(str(tiny_tied), device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=32) as llm:
        expected = llm.generate(["hello", "def foo("], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    for line, prompt, c in zip(lines, ["hello", "def foo("], expected):
        assert line == f"Prompt: {prompt!r}, Generated text: {c.text!r}"


def test_unknown_flag_errors():
    out = run("--no-such-flag", timeout=60)
    assert out.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in out.stderr


def test_bad_engine_value_errors():
    out = run("--block-size", "3", "--port", "0", timeout=60)
    assert out.returncode == 2
    assert "argument --block-size: block_size must be a power of 2" in out.stderr


@pytest.mark.parametrize(
    "args, refusal",
    [
        (["--dtype", "float33"], "argument --dtype: invalid choice: 'float33'"),
        (["--attention-backend", "cudnn"], "argument --attention-backend: invalid choice: 'cudnn'"),
        (["--external-workers"], "argument --worker-address: worker_address is required with external_workers"),
        (["--max-tok", "3"], "unrecognized arguments: --max-tok"),  # abbreviations are refused
        (["--http-port", "0", "--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    ],
)
def test_a_bad_flag_is_refused_by_name_before_any_worker_starts(args, refusal):
    out = run(*args, "--port", "0", "--device", "cpu", timeout=60)
    assert out.returncode == 2 and refusal in out.stderr, out.stderr
    assert "listening" not in out.stdout


def test_every_engine_field_is_a_flag():
    out = run("--help", timeout=60)
    assert out.returncode == 0
    help_text = " ".join(out.stdout.split())
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        assert flag in help_text, flag
        if f.type == "bool":
            assert f"--no-{f.name.replace('_', '-')}" in help_text
    for flag in ("--tp", "--host", "--port", "--token", "--prompt", "--external-workers", "--worker-address"):
        assert flag in help_text


def test_non_loopback_host_needs_a_token():
    out = run("--host", "0.0.0.0", "--port", "0", timeout=60)
    assert out.returncode == 1
    assert "--token" in out.stderr


def test_a_start_up_failure_exits_1_and_leaves_no_dir(tiny_tied, tmp_path):
    # the workers start, then fail to load (no weights): a supervisor sees a failure, and the engine's private dir
    # is gone with them
    model = tmp_path / "no_weights"
    shutil.copytree(tiny_tied, model, ignore=shutil.ignore_patterns("*.safetensors"))
    tmp = Path(tempfile.mkdtemp(prefix="launch-", dir="/tmp"))  # short: the worker socket's path must fit
    try:
        env = dict(os.environ, TMPDIR=str(tmp))
        out = subprocess.run(
            [*LAUNCH, "--port", "0", "--model", str(model), "--device", "cpu"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert out.returncode == 1, out.stderr
        assert "no *.safetensors files" in out.stderr and "listening" not in out.stdout
        assert list(tmp.iterdir()) == []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
