"""uvicorn's Server with the front-end's signal handling (imported when serving: uvicorn stays out of ``--help``)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

import uvicorn
from uvicorn.server import HANDLED_SIGNALS


class Server(uvicorn.Server):
    """uvicorn's, with two changes to its signals. A signal ignored when the server starts stays ignored: under
    launch.py the front-end ignores SIGINT and SIGTERM, since a Ctrl-C or systemd's stop reaches the whole process
    group and the parent owns the orderly shutdown (it drains the requests in flight, then stops us with
    STOP_SIGNAL). And a SIGINT is not raised again after the graceful shutdown, as uvicorn does (here a
    KeyboardInterrupt traceback and exit -2): ``serve`` returns and the process exits 0. A SIGTERM still is, so a
    standalone front-end ends by it as before."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be set from the main thread
            return
        handled = [sig for sig in HANDLED_SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN]
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)
        for sig in reversed(self._captured_signals):
            if sig in originals and sig != signal.SIGINT:  # not STOP_SIGNAL, which the loop handles for the parent
                signal.raise_signal(sig)
