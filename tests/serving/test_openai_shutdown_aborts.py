"""A request the server aborts while its HTTP client still waits (a shutdown past its drain) is an error, never a
success: a non-streamed one gets 503 in OpenAI's shape saying it was aborted (it once got 200 with finish_reason
"abort"), a streamed one an error event before [DONE]; and the front-end logs each 5xx with its traceback."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import openai

from tests.support.openai_http import HttpServer
from tests.support.processes import ROOT

KEY = "abort-key"
WAIT_S = 120  # generous: the box may be busy
LONG = {"max_tokens": 480, "ignore_eos": True}  # the whole context (512): running when the stop comes


def _abort_at_once_flags() -> list[str]:
    """No drain where the launcher has one (--shutdown-timeout 0): every request in flight is aborted at once."""
    out = subprocess.run([sys.executable, str(ROOT / "launch.py"), "--help"], capture_output=True, text=True, cwd=ROOT)
    return ["--shutdown-timeout", "0"] if "--shutdown-timeout" in out.stdout else []


def test_requests_aborted_by_a_shutdown_are_errors_not_200s(tiny_tied, tmp_path):
    flags = ["--api-key", KEY, *_abort_at_once_flags()]
    with HttpServer(tiny_tied, tmp_path / "server.log", *flags) as server:
        api = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=WAIT_S)
        model = api.models.list().data[0].id
        plain: list = []  # each non-streamed request's outcome: its response or the exception
        events: list[str] = []

        def complete(prompt: str) -> None:
            try:
                plain.append(api.completions.create(model=model, prompt=prompt, extra_body=LONG))
            except Exception as e:
                plain.append(e)

        def stream() -> None:
            body = {"prompt": "streamed", "stream": True, **LONG}
            headers = {"Authorization": f"Bearer {KEY}"}
            with httpx.stream(
                "POST", server.base_url + "/completions", json=body, headers=headers, timeout=WAIT_S
            ) as r:
                events.extend(x.removeprefix("data: ") for x in r.iter_lines() if x.startswith("data: "))

        threads = [threading.Thread(target=complete, args=(f"prompt {i}",)) for i in range(4)]
        threads.append(threading.Thread(target=stream))
        for t in threads:
            t.start()
        deadline = time.monotonic() + WAIT_S
        while len(events) < 3 and time.monotonic() < deadline:  # all five are running by now
            time.sleep(0.01)
        assert len(events) >= 3, server.stderr()
        server.proc.terminate()  # SIGTERM: the launcher stops, aborting what is in flight
        for t in threads:
            t.join(WAIT_S)
        assert not any(t.is_alive() for t in threads)
        log = server.stderr()

    assert len(plain) == 4
    for outcome in plain:
        assert isinstance(outcome, openai.APIStatusError), f"a success for an aborted request: {outcome}"
        assert outcome.status_code == 503 and "abort" in outcome.message, outcome
        assert outcome.body["type"] == "ServiceUnavailableError"
    assert events[-1] == "[DONE]", events[-3:]
    assert '"error"' in events[-2] and "abort" in events[-2], events[-3:]
    assert '"finish_reason":"abort"' not in "".join(events)
    assert "503: the request was aborted" in log and "Traceback" in log, log[-3000:]
