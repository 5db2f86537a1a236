"""A zero-filled tensor whose host memory is committed only where it is written: the CPU KV pool (1 GiB by default)
took 0.3-1.2 s to fill at start-up with ``torch.zeros``, one write to every page. Anonymous mmap pages read as zeros
by the kernel's guarantee and cost their fault only when first touched, as a step writes its blocks."""

from __future__ import annotations

import math
import mmap

import torch

_EAGER_BYTES = 1 << 20  # smaller buffers: torch.zeros (the allocator's, no mapping of their own)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``; on the CPU, large ones as lazily committed zero pages."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < _EAGER_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype).view(shape)  # the tensor holds a reference: unmapped with it
