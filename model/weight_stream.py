"""Checkpoint bytes to the target device at the disk's speed: a reader thread reads the planned byte ranges in file
order with large positional reads (``os.preadv``, which drops the GIL), while the caller's thread copies and loads.

CUDA: the reader fills a few reused pinned buffers of ``CHUNK`` bytes; the caller copies each into a device staging
tensor with ``non_blocking=True`` and hands the buffer back with an event that the reader waits on before reusing it,
so the disk read of one chunk overlaps the host-to-device copy of the one before. The copies go on the current
stream, in order with the loaders' device-to-device cuts that read them: a side stream would buy no overlap (both
copies run far faster than any disk) and would need ``record_stream`` bookkeeping. CPU: no thread and no staging; the
tensors are views of the mapped file, the loaders copy out of the page cache, and ``MADV_WILLNEED`` keeps the
disk reading ahead of them.

A rank that needs only some rows of a tensor reads only their bytes; the tensor it gets still has the tensor's full
shape (the loaders take the full tensor and cut their shard), its other rows left unread."""

from __future__ import annotations

import itertools
import mmap
import os
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from model.safetensors_reader import TensorEntry

CHUNK = 16 << 20  # one pinned buffer: dd's own block size, large enough for the disk to stream
DEPTH = 8  # pinned buffers in flight
# staged: bytes the kernel is asked to read (WILLNEED) beyond the read in progress; 0: only its own readahead, as dd
# has. Off by default: on this project's dev VM, 16 MB preads alone ran at dd's 2.2-2.4 GB/s and with 64 MB asked
# ahead at 1.2-1.4 GB/s (benchmarks/load_weights.py's "auto:ahead=64" measures it on another disk)
READ_AHEAD = 0
UNREAD_FILL: int | None = None  # tests set a byte here: the staged rows a rank does not read hold it, not stale data
PREFETCH = 256 << 20  # CPU: bytes the kernel reads ahead of the tensor being loaded
_DONE = object()


@dataclass(slots=True, frozen=True)
class Piece:
    """Rows [lo, hi) of one tensor of ``path`` to read; ``target`` is the caller's (where they go)."""

    path: Path
    entry: TensorEntry
    lo: int
    hi: int
    target: object = None

    @property
    def byte_lo(self) -> int:
        """Offset of the first byte to read within the tensor."""
        return self.lo * self.entry.row_bytes

    @property
    def nbytes(self) -> int:
        return (self.hi - self.lo) * self.entry.row_bytes


class _Stopped(Exception):
    pass


class _ReadAhead:
    """Asks the kernel for the planned bytes up to ``READ_AHEAD`` beyond the read in progress (``WILLNEED`` queues
    the reads and returns): with requests in flight past the one being copied, a fast disk never waits on us."""

    def __init__(self, pieces: list[Piece]) -> None:
        self.pieces, self.j, self.off, self.pos = pieces, 0, 0, 0  # next piece, offset in it, plan position

    def start_file(self, i: int, pos: int) -> None:
        if self.j < i:  # the previous file's tail was never asked for: skip it
            self.j, self.off, self.pos = i, 0, pos

    def until(self, fd: int, path: Path, limit: int) -> None:
        while self.j < len(self.pieces) and self.pos < limit and self.pieces[self.j].path == path:
            p = self.pieces[self.j]
            n = min(p.nbytes - self.off, limit - self.pos, CHUNK)
            if n > 0:
                os.posix_fadvise(fd, p.entry.start + p.byte_lo + self.off, n, os.POSIX_FADV_WILLNEED)
            self.off, self.pos = self.off + n, self.pos + n
            if self.off >= p.nbytes:
                self.j, self.off = self.j + 1, 0


class _Reader(threading.Thread):
    def __init__(self, pieces: list[Piece], device: torch.device, free: queue.Queue, ready: queue.Queue) -> None:
        super().__init__(name="nanoserve-weight-reader", daemon=True)
        self.pieces, self.device, self.free, self.ready = pieces, device, free, ready
        self.stop = threading.Event()
        self.ahead = _ReadAhead(pieces)

    def run(self) -> None:
        fd, path, pos = -1, None, 0
        try:
            if self.device.type == "cuda":
                # a new thread's current device is 0: without this, its first event wait would create a context
                # there, memory on another rank's GPU
                torch.cuda.set_device(self.device)
            for i, piece in enumerate(self.pieces):
                if piece.path != path:
                    if fd >= 0:
                        os.close(fd)
                    fd, path = os.open(piece.path, os.O_RDONLY), piece.path
                    if hasattr(os, "posix_fadvise"):  # Linux: a larger readahead window (macOS has no fadvise)
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    self.ahead.start_file(i, pos)
                self._read_chunks(fd, i, piece, pos)
                pos += piece.nbytes
            self.ready.put(_DONE)
        except _Stopped:
            pass
        except BaseException as e:  # the caller's thread raises it
            self.ready.put(e)
        finally:
            if fd >= 0:
                os.close(fd)

    def _take(self):
        while True:
            try:
                return self.free.get(timeout=0.1)
            except queue.Empty:
                if self.stop.is_set():
                    raise _Stopped from None

    def _read_chunks(self, fd: int, i: int, piece: Piece, pos: int) -> None:
        start, n = piece.entry.start + piece.byte_lo, piece.nbytes
        for off in range(0, n, CHUNK) if n else [0]:
            m = min(CHUNK, n - off)
            if READ_AHEAD and hasattr(os, "posix_fadvise"):
                self.ahead.until(fd, piece.path, pos + off + m + READ_AHEAD)
            buf, event = self._take()
            if event is not None:
                event.synchronize()  # its last copy to the device is done
            _pread(fd, buf.numpy()[:m], start + off, piece)
            self.ready.put((i, buf, off, m, off + m >= n))


def _pread(fd: int, out, offset: int, piece: Piece) -> None:
    view = memoryview(out).cast("B")
    while view.nbytes:
        got = os.preadv(fd, [view], offset)
        if got == 0:
            raise ValueError(
                f"{piece.path}: tensor {piece.entry.name!r}: the file ended at byte {offset}, inside the tensor "
                "(truncated while loading?)"
            )
        view, offset = view[got:], offset + got


def _as_tensor(raw: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    return raw[: entry.nbytes].view(entry.dtype).view(entry.shape)


def stream(
    pieces: list[Piece], device: torch.device, staged: bool | None = None
) -> Iterator[tuple[Piece, torch.Tensor]]:
    """Each piece in order with its tensor on ``device`` (full shape; only rows lo..hi read). The tensor is valid
    until the next item; close the generator (``contextlib.closing``) to stop the reader early. ``staged``: the
    reader thread and staging copies (the default on CUDA; on the CPU for tests and benchmarks), else mapped views."""
    if staged is None:
        staged = device.type == "cuda"
    return _stream_staged(pieces, device) if staged else _stream_mmap(pieces)


def _stream_staged(pieces: list[Piece], device: torch.device) -> Iterator[tuple[Piece, torch.Tensor]]:
    cuda = device.type == "cuda"
    if cuda and device.index is None:  # resolved here: the reader thread's own current device is 0
        device = torch.device("cuda", torch.cuda.current_device())
    free, ready = queue.Queue(), queue.Queue()
    for _ in range(DEPTH):
        free.put((torch.empty(CHUNK, dtype=torch.uint8, pin_memory=cuda), None))
    reader = _Reader(pieces, device, free, ready)
    reader.start()
    staging = None
    try:
        while (item := ready.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            i, buf, off, n, last = item
            piece = pieces[i]
            if off == 0:
                staging = torch.empty(piece.entry.nbytes, dtype=torch.uint8, device=device)
                if UNREAD_FILL is not None:
                    staging.fill_(UNREAD_FILL)
            event = None
            if n:
                dst = staging[piece.byte_lo + off : piece.byte_lo + off + n]
                dst.copy_(buf[:n], non_blocking=cuda)
                if cuda:
                    event = torch.cuda.Event()
                    event.record(torch.cuda.current_stream(device))
            free.put((buf, event))
            if last:
                yield piece, _as_tensor(staging, piece.entry)
                staging = None
    finally:
        reader.stop.set()
        reader.join()


def _stream_mmap(pieces: list[Piece]) -> Iterator[tuple[Piece, torch.Tensor]]:
    """CPU: tensors are views of the mapped files, the loaders copy straight out of the page cache; the kernel reads
    ``PREFETCH`` bytes ahead of the tensor being loaded (``MADV_WILLNEED`` queues the reads and returns)."""
    maps: dict[Path, tuple[mmap.mmap, torch.Tensor]] = {}
    ends = list(itertools.accumulate(p.nbytes for p in pieces))
    ahead = 0
    for i, piece in enumerate(pieces):
        while ahead < len(pieces) and (ahead <= i or ends[ahead] - ends[i] < PREFETCH):
            _will_need(_mapped(maps, pieces[ahead].path)[0], pieces[ahead])
            ahead += 1
        mm, data = _mapped(maps, piece.path)
        entry = piece.entry
        if len(mm) < entry.start + entry.nbytes:  # the file shrank since its header was read
            raise ValueError(
                f"{piece.path}: tensor {entry.name!r}: the file ended at byte {len(mm)}, inside the tensor "
                "(truncated while loading?)"
            )
        raw = data[entry.start : entry.start + entry.nbytes]
        if entry.start % entry.dtype.itemsize:  # a misaligned tensor (no writer we know of makes one): copied
            raw = raw.clone()
        yield piece, _as_tensor(raw, entry)


def _mapped(maps: dict, path: Path) -> tuple[mmap.mmap, torch.Tensor]:
    if path not in maps:
        with open(path, "rb") as f:  # the mapping outlives the descriptor
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private and writable: torch wants writable
        maps[path] = mm, torch.frombuffer(mm, dtype=torch.uint8)
    return maps[path]


def _will_need(mm: mmap.mmap, piece: Piece) -> None:
    start = piece.entry.start + piece.byte_lo
    end = min(start + piece.nbytes, len(mm))  # a truncated file is reported when its tensor's turn comes
    if end > start:
        aligned = start - start % mmap.PAGESIZE
        mm.madvise(mmap.MADV_WILLNEED, aligned, end - aligned)
