"""The coordinator counts GPUs without torch (coordinator/gpu_probe.py): NVML through ctypes, narrowed by
CUDA_VISIBLE_DEVICES as CUDA narrows it. A stand-in NVML library, compiled here, answers the real ctypes calls; on
a GPU host the count must equal torch's under each CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from coordinator import gpu_probe
from coordinator.config import EngineConfig

FAKE_NVML = r"""
#include <stdlib.h>
static int live = 0;
int nvmlInit_v2(void) { live = 1; return atoi(getenv("FAKE_NVML_INIT_RC") ? getenv("FAKE_NVML_INIT_RC") : "0"); }
int nvmlDeviceGetCount_v2(unsigned int *count) { if (!live) return 1; *count = COUNT; return 0; }
int nvmlShutdown(void) { live = 0; return 0; }
"""


@pytest.fixture(scope="module")
def fake_nvml(tmp_path_factory):
    """A shared library with NVML's three entry points, reporting 3 devices."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the stand-in NVML library")
    d = tmp_path_factory.mktemp("nvml")
    (d / "nvml.c").write_text(FAKE_NVML)
    subprocess.run([compiler, "-shared", "-fPIC", "-DCOUNT=3", "-o", d / "libnvml.so", d / "nvml.c"], check=True)
    return str(d / "libnvml.so")


@pytest.mark.parametrize(
    "spec, shown",
    [
        (None, 4),  # unset: every device
        ("", 0),
        ("-1", 0),
        ("0", 1),
        ("3,1", 2),
        ("0,1,2,3", 4),
        ("1,7,2", 1),  # read up to the first index out of range
        ("1,1", 0),  # an index named twice hides them all
        ("2,0,2", 0),
        ("GPU-8e1a, 2", 2),
        ("MIG-aa,nonsense,0", 1),
    ],
)
def test_cuda_visible_devices_narrows_the_count_as_cuda_does(spec, shown):
    assert gpu_probe.visible_count(spec, 4) == shown


def test_nvml_is_asked_through_ctypes(fake_nvml, monkeypatch):
    assert gpu_probe.nvml_device_count(fake_nvml) == 3
    monkeypatch.setenv("FAKE_NVML_INIT_RC", "9")  # a driver that does not initialise: no answer, not 0
    assert gpu_probe.nvml_device_count(fake_nvml) is None
    assert gpu_probe.nvml_device_count("/nonexistent/libnvidia-ml.so.1") is None


def test_the_device_default_and_the_gpu_check_use_the_count(fake_nvml, monkeypatch):
    monkeypatch.setattr(gpu_probe, "gpu_driver_present", lambda: True)
    real = gpu_probe.nvml_device_count
    monkeypatch.setattr(gpu_probe, "nvml_device_count", lambda: real(fake_nvml))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert gpu_probe.cuda_gpu_count() == 2
    assert EngineConfig().device == "cuda"
    cfg = EngineConfig(device="cuda", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 needs 3 GPU.*shows 2") as e:
        cfg.check_local_gpus()
    assert e.value.name == "tensor_parallel_size"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert EngineConfig().device == "cpu"


def test_no_driver_means_no_gpu_without_asking_anything(monkeypatch):
    monkeypatch.setattr(gpu_probe, "gpu_driver_present", lambda: False)
    monkeypatch.setattr(gpu_probe, "nvml_device_count", lambda: pytest.fail("NVML asked without a driver"))
    assert gpu_probe.cuda_gpu_count() == 0


COUNT_BOTH = (
    "import json, torch; from coordinator.gpu_probe import cuda_gpu_count; "
    "print(json.dumps([cuda_gpu_count(), torch.cuda.device_count()]))"
)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [None, "0", "", "-1", "0,0", "0,5"])
def test_the_count_equals_torchs_on_a_gpu_host(spec):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    if spec is not None:
        env["CUDA_VISIBLE_DEVICES"] = spec
    out = subprocess.run([sys.executable, "-c", COUNT_BOTH], env=env, capture_output=True, text=True, check=True)
    ours, torchs = json.loads(out.stdout.splitlines()[-1])
    assert gpu_probe.nvml_device_count() is not None, "NVML did not answer on a GPU host"
    assert ours == torchs, (spec, ours, torchs)
