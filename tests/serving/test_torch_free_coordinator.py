"""launch.py's coordinator serves the embedded default model without ever loading torch (~1.2 s of CPU off every
start on a CPU host, 3-4 s of a GPU host's): the device default counts GPUs without torch, through NVML on a GPU
host (coordinator/gpu_probe.py), the model's config is read without it (model/config.py) and the tokenizer is built
without transformers' auto classes (coordinator/tokenizer_loader.py); its worker loads torch as before. Chat prompts
and generation work as usual."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from client import Client, SamplingParams
from coordinator.gpu_probe import gpu_driver_present, nvml_device_count
from tests.support.announced import LISTENING, AnnouncedProcess
from tests.support.processes import children_of
from tests.support.transformers_torch import tokenizer_import_loads_torch

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or (gpu_driver_present() and nvml_device_count() is None),
    reason="a GPU driver NVML cannot ask: the device default loads torch to ask it, as it should",
)


def _has_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_the_coordinator_serves_the_embedded_model_without_torch(tmp_path):
    if tokenizer_import_loads_torch():
        pytest.skip("this transformers imports torch with PreTrainedTokenizerFast (5.17 does)")
    cmd = [sys.executable, "launch.py", "--port", "0"]
    with AnnouncedProcess(cmd, tmp_path / "launch.log", (LISTENING,)) as launch:
        address = launch.words[LISTENING][3]
        with Client(address) as c:
            chat = c.chat([{"role": "user", "content": "def f(x):"}], SamplingParams(max_tokens=4, temperature=0))
            plain = c.generate("import os\n", SamplingParams(max_tokens=4, temperature=0))
        assert len(chat.token_ids) == 4 and len(plain.token_ids) == 4
        workers = children_of(launch.proc.pid)
        assert workers and all(_has_torch(w) for w in workers)  # the check sees torch where it is loaded
        assert not _has_torch(launch.proc.pid), launch.stderr()
