"""Host -> device copies of a step's small index arrays, in one place.

A pageable host->device copy larger than the driver's inline limit (~64 KB: a batch-256 block table, a prefill's
slot mapping) waits for the work already queued on the stream before it returns, so the worker could not
prepare step N+1 while step N runs (measured: pipelined batch-256 steps were slower than synchronous ones).
``HostStager`` copies each larger array into a slot of a pinned ring allocated once and issues a truly
asynchronous copy from there; small arrays, which the driver sends inline without waiting, keep the cheaper
pageable copy. ``pin_memory()`` per array avoids the wait too but allocates every time, which costs more host
time than it saves.
"""

from __future__ import annotations

import numpy as np
import torch

_NP_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}
_ALIGN = 64
_INLINE_BYTES = 16 << 10  # well under the driver's ~64 KB inline limit for pageable host->device copies


def to_device(arr: np.ndarray, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A pageable copy (or, on CPU, a tensor owning its memory)."""
    arr = np.ascontiguousarray(arr, dtype=_NP_DTYPES[dtype])  # converts on the host: one copy at most
    if not arr.flags.writeable:  # a view of a message buffer; torch wants writable memory
        arr = arr.copy()
    host = torch.from_numpy(arr)
    return host.to(device, non_blocking=True) if device.type == "cuda" else host


class HostStager:
    """Pinned staging for a step's host->device copies: ``num_slots`` regions used in turn, one per step.

    ``begin_step`` moves to the next region after waiting for the copies last staged there (an event recorded
    when that region was left, i.e. after all of that step's work). Six regions: at most three steps are in
    flight (coordinator async_depth <= 2), so the step that last used a region has finished and the wait never
    blocks the launch of a step. Arrays of at most ``inline_bytes``, and arrays that do not fit the region, take
    a pageable copy.
    """

    def __init__(
        self, device: torch.device, slot_bytes: int = 4 << 20, num_slots: int = 6, inline_bytes: int = _INLINE_BYTES
    ) -> None:
        self.device = device
        self.inline_bytes = inline_bytes
        self.pinned = device.type == "cuda"
        self.slot = 0
        self.offset = 0
        if self.pinned:
            self.buffers = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(num_slots)]
            self.arrays = [b.numpy() for b in self.buffers]
            self.events: list[torch.cuda.Event | None] = [None] * num_slots

    def begin_step(self) -> None:
        if not self.pinned:
            return
        left = torch.cuda.Event()
        left.record()
        self.events[self.slot] = left
        self.slot = (self.slot + 1) % len(self.buffers)
        if self.events[self.slot] is not None:
            self.events[self.slot].synchronize()
        self.offset = 0

    def to_device(self, arr: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        if not self.pinned:
            return to_device(arr, self.device, dtype)
        arr = np.asarray(arr)
        np_dtype = _NP_DTYPES[dtype]
        nbytes = arr.size * np.dtype(np_dtype).itemsize
        start = -(-self.offset // _ALIGN) * _ALIGN
        if nbytes <= self.inline_bytes or start + nbytes > len(self.arrays[self.slot]):
            return to_device(arr, self.device, dtype)
        self.offset = start + nbytes
        staged = self.arrays[self.slot][start : start + nbytes].view(np_dtype).reshape(arr.shape)
        np.copyto(staged, arr, casting="unsafe")
        host = self.buffers[self.slot][start : start + nbytes].view(dtype).view(arr.shape)
        return host.to(self.device, non_blocking=True)
