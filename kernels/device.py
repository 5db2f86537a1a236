"""Device facts that kernel launch policies read on every call, looked up once per device."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device, cpu: int) -> int:
    """Streaming multiprocessors of a CUDA ``device``; ``cpu`` for a CPU device (Triton's interpreter, where a
    small grid keeps tests fast)."""
    if device.type != "cuda":
        return cpu
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
