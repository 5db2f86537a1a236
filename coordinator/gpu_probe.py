"""How many CUDA GPUs a worker spawned here would see, asked without torch: importing it and initialising CUDA
cost the coordinator 3-4 s of a GPU host's start, ahead of the worker config (log 53). NVIDIA's management library
(NVML, part of the driver) counts the devices in milliseconds; CUDA_VISIBLE_DEVICES narrows the count as CUDA
does. Where NVML cannot answer (ROCm, WSL, no library) torch is asked as before."""

from __future__ import annotations

import ctypes
import glob
import sys

from settings.env import settings

# a GPU driver's device files (NVIDIA, ROCm, WSL's): where none exists, CUDA cannot be available
GPU_DRIVER_FILES = ("/dev/nvidia*", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")


def gpu_driver_present() -> bool:
    """False only where a Linux host shows no GPU driver at all (elsewhere: unknown, so True)."""
    return sys.platform != "linux" or any(glob.glob(pattern) for pattern in GPU_DRIVER_FILES)


def nvml_device_count(library: str = "libnvidia-ml.so.1") -> int | None:
    """The devices NVML counts on this host (or in this container), or None where it cannot answer."""
    try:
        nvml = ctypes.CDLL(library)
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        count = ctypes.c_uint(0)
        return count.value if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0 else None
    finally:
        nvml.nvmlShutdown()


def visible_count(spec: str | None, found: int) -> int:
    """The devices CUDA shows of ``found`` under CUDA_VISIBLE_DEVICES=``spec``: its list is read up to the first
    entry that names no device (an index out of range, "-1", ...), and an index named twice hides every device
    (CUDA shows none for "0,0": log 53c). UUIDs ("GPU-...", "MIG-...") are taken as valid: checking them would need
    NVML's UUID table, and a wrong one fails in the worker by name."""
    if spec is None:
        return found
    seen: set[int] = set()
    shown = 0
    for item in (part.strip() for part in spec.split(",")):
        if item.isdigit():
            index = int(item)
            if index in seen:
                return 0
            if index >= found:
                break
            seen.add(index)
        elif not item.startswith(("GPU-", "MIG-")):
            break
        shown += 1
    return shown


def cuda_gpu_count() -> int:
    """The CUDA GPUs a process spawned here sees: 0 without a driver, NVML's count narrowed by
    CUDA_VISIBLE_DEVICES where NVML answers, else torch's (which imports it)."""
    if not gpu_driver_present():
        return 0
    found = nvml_device_count()
    if found is not None:
        return visible_count(settings().cuda_visible_devices, found)
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
