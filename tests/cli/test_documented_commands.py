"""The documented commands run: every block the README and docs/ mark ``<!-- cpu-test -->`` runs on the CPU with the
embedded model (tests/support/doc_commands.py says how), so the docs cannot drift from the code. A page's blocks
run in a private network namespace, where the ports they name are free whatever else this host runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from benchmarks.pipe_lines import PipeLines
from tests.support.doc_commands import MARKER, Page, marked_blocks, run_page, shell_commands
from tests.support.processes import ROOT
from tests.support.timeouts import HANG_S, START_S

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKED = [p for p in PAGES if marked_blocks(p)]


def _namespace_problem() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare command"
    out = subprocess.run(
        ["unshare", "-rn", "ip", "link", "set", "lo", "up"], capture_output=True, text=True, timeout=60
    )
    return None if out.returncode == 0 else f"unshare -rn failed: {out.stderr.strip()}"


def test_the_readme_marks_its_first_command_and_the_clients():
    blocks = marked_blocks(ROOT / "README.md")
    assert len(blocks) >= 3
    assert any("launch.py" in c for c in shell_commands(blocks[0].text)), "the README's first command is unmarked"
    # a marker only ever sits right above a fence: one anywhere else would mark nothing, silently
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines[:-1]):
            if line.strip() == MARKER:
                assert lines[i + 1].startswith("```"), f"{page.name}:{i + 1}: {MARKER} not right above a fence"


def test_setup_steps_are_skipped_and_continuations_joined():
    text = "python3 -m venv .venv && .venv/bin/pip install -e . && python launch.py  # serve\n# a comment\n\na \\\n  b"
    assert shell_commands(text) == ["python launch.py  # serve", "a    b"]


@pytest.mark.parametrize("page", MARKED, ids=[p.name for p in MARKED])
def test_the_marked_blocks_of_a_page_run(page):
    problem = _namespace_problem()
    if problem:
        pytest.skip(f"needs a private network namespace for the documented ports: {problem}")
    module = [sys.executable, "-m", "tests.support.doc_commands", str(page.relative_to(ROOT))]
    script = 'ip link set lo up && exec "$@"'  # the namespace's loopback, for 127.0.0.1
    out = subprocess.run(
        ["unshare", "-rn", "bash", "-c", script, "bash", *module],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=START_S * (1 + len(marked_blocks(page))),
    )
    assert out.returncode == 0, out.stderr[-4000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    failed = [f"{r['where']}: {r['output']}" for r in results if not r["ok"]]
    assert not failed, "\n\n".join(failed)
    assert len(results) == len(marked_blocks(page))


def test_a_command_that_drifted_from_the_code_fails_its_page(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        f"{MARKER}\n```\npython -c 'print(6 * 7)'\n```\n\n```\nnot marked: never run\n```\n"
        f"{MARKER}\n```\npython launch.py --prompt hi --no-such-flag\n```\n"
        f"{MARKER}\n```python\nfrom nanoserve import NoSuchName\n```\n"
    )
    results = run_page(page)
    assert [(r["where"], r["ok"]) for r in results] == [
        ("page.md:2", True),
        ("page.md:10", False),
        ("page.md:14", False),
    ]
    assert results[0]["output"] == "42\n"
    assert "exited 2" in results[1]["output"] and "unrecognized arguments: --no-such-flag" in results[1]["output"]
    assert "ImportError" in results[2]["output"]


def test_a_ready_line_that_comes_with_the_line_before_it_is_seen(tmp_path):
    # one write of two lines, then silence: the ready line must not wait unseen in a read-ahead buffer until the
    # start-up deadline (it did, on a loaded box, where uvicorn's line and ours came in one read)
    server = tmp_path / "server.py"
    server.write_text(
        "import sys, time\n"
        "sys.stdout.write('uvicorn started\\nnanoserve listening on tcp://127.0.0.1:1\\n')\n"
        "sys.stdout.flush()\n"
        "time.sleep(600)\n"
    )
    page = Page(dict(os.environ))
    started = time.monotonic()
    page.start_server(f"{sys.executable} {server}")
    try:
        assert time.monotonic() - started < START_S / 2
    finally:
        page.server.kill()
        page.server.wait()
        page.server.stdout.close()


def test_pipe_lines_gives_whole_lines_and_the_unended_rest_at_the_end():
    code = (
        "import sys, time\nsys.stdout.write('a\\nb')\nsys.stdout.flush()\ntime.sleep(0.3)\nsys.stdout.write('c\\nd')\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    reader, lines = PipeLines(proc.stdout), []
    try:
        deadline = time.monotonic() + HANG_S
        while not reader.ended and time.monotonic() < deadline:
            lines += reader.poll(0.2)
    finally:
        reader.close()
        proc.wait()
        proc.stdout.close()
    assert lines == ["a\n", "bc\n", "d"]  # "b" waits for its newline; "d" comes at the end of the output
