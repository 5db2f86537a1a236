"""Host -> device copies of a step's small index arrays, in one place.

Measured on an H200 (docs/PERF.md, log 5): staging each array through pinned memory (``pin_memory()`` per
array) avoids the stream sync of a pageable copy but costs more host time than it saves (W2 Qwen3-0.6B went
from 1.54 to 1.88 ms/token), so copies are plain pageable ones. Fewer, larger copies are the next step.
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
    return host.to(device, non_blocking=True) if device.type == "cuda" else host
