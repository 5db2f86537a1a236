"""benchmarks/frontend_cpu.py drives the real app in-process with its stand-in engine: every request answers 200
with the whole stream, and the figures it prints are there (a change of the engine interface breaks it here)."""

from __future__ import annotations

from benchmarks.frontend_cpu import main


def test_frontend_cpu_runs_the_app(capsys):
    res = main(["--requests", "20", "--rounds", "1", "--tokens", "2", "12"])
    assert res["us_per_request_2_tokens"] > 0 and res["us_per_request_12_tokens"] > 0 and "us_per_token" in res
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("{")
