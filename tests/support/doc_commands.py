"""The documented commands a test runs: every fenced block that a README or docs/ page marks with the line
``<!-- cpu-test -->`` right above it, run as a reader would on a CPU machine, from the checkout's root.

    python -m tests.support.doc_commands README.md     # prints one JSON line: each marked block's outcome

How a block runs:
  - A ``python`` block is one program (this interpreter); it must exit 0.
  - Any other block is shell: each line a command (a trailing ``\\`` joins the next), run by bash; ``python``,
    ``python3``, ``nanoserve`` and ``.venv/bin/X`` are this environment's. Set-up steps chained with ``&&``
    (``python3 -m venv ...``, ``pip install ...``) are skipped: the test runs in the environment they made.
  - A command that starts a server (``launch.py`` or ``nanoserve serve``, without ``--prompt``) runs in the
    background; the next command waits until it is ready (its "OpenAI API on" line when it serves HTTP, else its
    "nanoserve listening on" line). It serves the page's later blocks until the next server command or the page's
    end, then gets SIGTERM and must exit 0.
The page's ports are its own: the test runs this module in a private network namespace (``unshare -rn``) where the
documented ports (8000, 8765) are free."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.pipe_lines import PipeLines
from tests.support.processes import ROOT
from tests.support.timeouts import HANG_S, START_S

MARKER = "<!-- cpu-test -->"
_FENCE = re.compile(r"^```(\w*)\s*$")
_SETUP = re.compile(r"^\s*(python3? -m venv|\S*pip3? install)\b")
_SERVER = re.compile(r"(^|\s)(\S*launch\.py|nanoserve serve)(\s|$)")


@dataclass(slots=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def marked_blocks(path: Path) -> list[Block]:
    """The fenced blocks of ``path`` whose fence has the marker on the line above it."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
        if i > 0 and lines[i - 1].strip() == MARKER:
            page = str(path.resolve().relative_to(ROOT)) if path.resolve().is_relative_to(ROOT) else path.name
            blocks.append(Block(page, i + 1, m.group(1), "\n".join(lines[i + 1 : end])))
        i = end + 1
    return blocks


def shell_commands(text: str) -> list[str]:
    """A shell block's commands: continuations joined, blank and comment lines and set-up steps dropped."""
    out: list[str] = []
    for line in text.replace("\\\n", " ").splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        kept = [part for part in line.split("&&") if not _SETUP.match(part)]
        if kept:
            out.append("&&".join(kept).strip())
    return out


def is_server(command: str) -> bool:
    return bool(_SERVER.search(command.split("#")[0])) and "--prompt" not in command


class Page:
    """Runs one page's marked blocks in order; ``servers`` started by them stay up for its later blocks."""

    def __init__(self, env: dict) -> None:
        self.env = env
        self.server: subprocess.Popen | None = None
        self.server_log = ""

    def start_server(self, command: str) -> None:
        self.stop_server()
        if "&&" in command or ";" in command.split("#")[0]:
            raise RuntimeError(f"{command!r}: a server command must be a command of its own (it gets the SIGTERM)")
        ready = "OpenAI API on" if ("nanoserve serve" in command or "--http-port" in command) else "listening on"
        self.server = subprocess.Popen(
            ["bash", "-c", f"exec {command}"],
            cwd=ROOT,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        reader = PipeLines(self.server.stdout)
        deadline, lines = time.monotonic() + START_S, []
        try:
            while not any(ready in line for line in lines):
                if self.server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{command!r} did not get ready:\n" + "".join(lines)[-3000:])
                lines += reader.poll(0.2)
        finally:
            reader.close()

    def stop_server(self) -> None:
        if self.server is None:
            return
        server, self.server = self.server, None
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(HANG_S)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            code = server.wait()
        rest = server.stdout.read()
        server.stdout.close()
        if code != 0:
            raise RuntimeError(f"the server exited {code} on SIGTERM:\n{rest[-3000:]}")

    def run(self, block: Block) -> str:
        """The block's output; RuntimeError naming the command that failed."""
        if block.lang == "python":
            with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
                f.write(block.text)
            try:
                return self._run([sys.executable, f.name], "the block")
            finally:
                os.unlink(f.name)
        out, pending = [], []
        for command in shell_commands(block.text) + [""]:
            if command and not is_server(command):
                pending.append(command)
                continue
            if pending:  # one bash for consecutive commands: an export or a cd carries on
                out.append(self._run(["bash", "-euo", "pipefail", "-c", "\n".join(pending)], "\n".join(pending)))
                pending = []
            if command:
                self.start_server(command)
        return "".join(out)

    def _run(self, argv: list[str], what: str) -> str:
        done = subprocess.run(argv, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=HANG_S)
        if done.returncode != 0:
            raise RuntimeError(f"{what!r} exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
        return done.stdout


def environment() -> dict:
    """This interpreter's environment for the commands: its bin first on PATH, .venv/bin/ pointing at it too."""
    bin_dir = str(Path(sys.executable).parent)
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""), PYTHONUNBUFFERED="1")
    env.pop("NANOSERVE_API_KEY", None)  # the documents' commands run without a key unless they set one
    return env


def run_page(path: Path) -> list[dict]:
    page = Page(environment())
    results = []
    for block in marked_blocks(path):
        text = block.text.replace(".venv/bin/", str(Path(sys.executable).parent) + "/")
        block = Block(block.page, block.line, block.lang, text)
        try:
            output = page.run(block)
            results.append({"where": block.where, "ok": True, "output": output[-2000:]})
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            results.append({"where": block.where, "ok": False, "output": str(e)})
    try:
        page.stop_server()
    except RuntimeError as e:
        results.append({"where": f"{path.name}: the last server", "ok": False, "output": str(e)})
    return results


if __name__ == "__main__":
    print(json.dumps(run_page(ROOT / sys.argv[1])))  # an absolute path stays itself
