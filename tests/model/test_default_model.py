"""The embedded default model (model/default_model/, trained by training/train_default_model.py on the Python
standard library): a small real checkpoint in the package, tokens equal to HF transformers' greedy ones on the CPU,
and ``python launch.py`` with no --model writes plausible Python."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from benchmarks.pipe_lines import PipeLines
from client import Client, SamplingParams
from model.tiny import default_model_dir
from tests.support.hf_oracle import Oracle
from tests.support.processes import ROOT
from tests.support.timeouts import HANG_S, START_S

PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef list_files(path):", "class Stack:\n    def push(self, item):"]
ENGINE = dict(device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=64)


def test_the_default_model_is_the_packaged_trained_checkpoint():
    from model.tiny import DEFAULT_MODEL_DIR

    path = default_model_dir()
    assert path == DEFAULT_MODEL_DIR and path.parent.name == "model"  # inside the package, nothing written at start
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["vocab_size"] > 512
    weights = path / "model.safetensors"
    assert weights.stat().st_size <= 20 << 20
    assert sum(t.numel() for t in load_file(weights).values()) <= 10_000_000
    record = json.loads((path / "training_record.json").read_text())
    assert record["python"].startswith("3.") and record["held_out_files"] > 0


def test_greedy_tokens_equal_hf_transformers_on_the_cpu():
    from nanoserve import LLM

    oracle = Oracle(default_model_dir())
    with LLM(**ENGINE) as llm:  # no model: the embedded default
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt_token_ids == oracle.ids(prompt)
        assert out.outputs[0].token_ids == oracle.greedy(out.prompt_token_ids, 24), prompt


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """``python launch.py`` with no --model (the embedded default) on the CPU; yields its ZMQ address."""
    log = open(tmp_path_factory.mktemp("launch") / "server.log", "w")
    cmd = [sys.executable, str(ROOT / "launch.py"), "--port", "0", "--device", "cpu", "--num-kv-blocks", "128"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=log, text=True)  # fmt: skip
    try:
        reader = PipeLines(proc.stdout)
        deadline, address = time.monotonic() + START_S, None
        while address is None:
            assert proc.poll() is None and time.monotonic() < deadline, open(log.name).read()[-3000:]
            for line in reader.poll(0.2):
                if line.startswith("nanoserve listening on "):
                    address = line.split()[-1]
        reader.close()
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(HANG_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_launch_without_a_model_answers_with_plausible_python(launched):
    # random weights write noise; the trained model continues a function header with an indented body in Python
    with Client(launched, timeout=HANG_S) as c:
        text = c.generate("def fibonacci(n):", SamplingParams(temperature=0.0, max_tokens=48)).text
    assert text.startswith("\n    "), repr(text)
    assert any(word in text for word in ('"""', "return", "if ", "for ", "pass", "raise")), repr(text)
