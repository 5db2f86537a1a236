"""Host -> device copies of a step's small index arrays that never stall the host.

A copy from pageable memory makes CUDA wait for all earlier work on the stream first, so preparing step N+1
would wait for step N to finish and the GPU would then idle while the host prepares. Staging through pinned
memory makes the copy truly asynchronous; PyTorch's caching host allocator keeps each pinned block alive until
its copy has run.
"""

from __future__ import annotations

import numpy as np
import torch

_NP_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


def to_device(arr: np.ndarray, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    arr = np.ascontiguousarray(arr, dtype=_NP_DTYPES[dtype])  # converts on the host: one copy at most
    if not arr.flags.writeable:  # a view of a message buffer; torch wants writable memory
        arr = arr.copy()
    host = torch.from_numpy(arr)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
