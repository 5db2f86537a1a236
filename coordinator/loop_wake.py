"""What wakes the coordinator's loop from its idle poll besides a client's frame: a tokenizer thread that finished a
job, or ``stop()``/``fail()`` from another thread or a signal handler. A pipe the loop polls beside its client
socket: each of them writes a byte, so the loop picks the result up at once rather than at its next poll timeout
(a Tokenize, a Detokenize, a long prompt's Generate used to wait up to 2 ms for it)."""

from __future__ import annotations

import os

import zmq


class LoopWake:
    def __init__(self, sock: zmq.Socket) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self.poller = zmq.Poller()
        self.poller.register(sock, zmq.POLLIN)
        self.poller.register(self._read, zmq.POLLIN)

    def watch(self, fd: int, events: int) -> None:
        """Watch a descriptor in the idle poll for ``events`` (zmq.POLLIN, zmq.POLLOUT; 0: no longer), as the local
        socket's listener and connections need."""
        if events:
            self.poller.register(fd, events)
        else:
            self.poller.unregister(fd)

    def __call__(self, *_args) -> None:
        """Wake the loop (any thread, a signal handler, a future's done callback)."""
        try:
            os.write(self._write, b"w")
        except OSError:  # the pipe is full (the loop wakes anyway) or closed (the loop is over)
            pass

    def wait(self, timeout_ms: int) -> None:
        """Until a frame, a wake, a signal or ``timeout_ms``; the wakes are consumed."""
        try:
            ready = dict(self.poller.poll(timeout_ms))
        except zmq.ZMQError:  # interrupted by a signal: the caller looks at its stop flag
            return
        if self._read in ready:
            try:
                while os.read(self._read, 4096):
                    pass
            except BlockingIOError:
                pass

    def close(self) -> None:
        for fd in (self._read, self._write):
            try:
                os.close(fd)
            except OSError:
                pass
