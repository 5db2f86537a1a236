"""The HTTP front-end as launch.py's child process: its socket, bound before the model loads, and the process
on it (``python -m openai_server --fd N --parent-pid PID``), watched so that its unasked exit fails the
service instead of leaving it up without its HTTP API."""

from __future__ import annotations

import errno
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable

from openai_server import STOP_SIGNAL
from openai_server.parser_flags import parser_flags_args

log = logging.getLogger("nanoserve.launch")


def bind_http(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound before the model loads (a port in use fails at once); the front-end inherits it."""
    bare = host.strip("[]")
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    try:
        sock = socket.create_server((bare, port), family=family, backlog=1024)
    except OSError as e:
        raise OSError(
            f"HTTP port {port} on {host} is already in use" if e.errno == errno.EADDRINUSE else f"HTTP: {e}"
        ) from None
    sock.set_inheritable(True)
    return sock


class HttpFrontEnd:
    """The front-end process (python -m openai_server) on ``bind_http``'s socket. If it ends by itself,
    ``on_exit(reason)`` runs: the service fails too, non-zero, so that a supervisor restarts the whole thing."""

    def __init__(
        self,
        args,
        sock: socket.socket,
        address: str,
        served_names: list[str],
        on_exit: Callable[[str], None],
        connect_timeout_s: float = 60.0,
    ) -> None:
        """``connect_timeout_s``: how long it waits for the coordinator's first answer (spawned before the engine
        starts, as long as that start-up may take)."""
        if not address.startswith("unix:"):  # the coordinator's local socket is taken as it is
            host, port = address.removeprefix("tcp://").rsplit(":", 1)
            local = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]"}.get(host, host)  # a wildcard bind: reached on loopback
            address = f"tcp://{local}:{port}"
        cmd = [
            sys.executable, "-m", "openai_server", "--address", address,
            "--fd", str(sock.fileno()), "--parent-pid", str(os.getpid()), "--served-model-name", *served_names,
            "--log-stats-interval", str(args.log_stats_interval), "--log-level", args.log_level,
            "--connect-timeout", str(connect_timeout_s),
        ]  # fmt: skip
        cmd += parser_flags_args(args)
        env = dict(os.environ)
        env.pop("NANOSERVE_API_KEY", None)
        if args.token:
            env["NANOSERVE_API_KEY"] = args.token  # not on the command line, where any local user could read it
        self.stopping = threading.Event()
        self.proc = subprocess.Popen(cmd, pass_fds=[sock.fileno()], env=env, stdin=subprocess.DEVNULL)
        self._on_exit = on_exit
        threading.Thread(target=self._watch, name="http-watch", daemon=True).start()

    def _watch(self) -> None:
        code = self.proc.wait()
        if not self.stopping.is_set():
            reason = f"the HTTP front-end exited with code {code}"
            log.error("%s: failing the requests in flight and shutting down", reason)
            self._on_exit(reason)

    def stop(self) -> None:
        self.stopping.set()
        if self.proc.poll() is None:
            self.proc.send_signal(STOP_SIGNAL)  # it ignores SIGTERM, which may have been meant for the whole group
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
