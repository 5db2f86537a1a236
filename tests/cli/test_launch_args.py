"""launch.py refuses bad arguments with one line naming the flag, before any worker starts: ports outside 0..65535,
--http-port equal to --port, and engine arguments the model cannot take (--max-model-len past its limit, a --tp
that does not divide what tensor parallelism splits)."""

from __future__ import annotations

import signal

import pytest

import coordinator.engine
import launch


def _parse_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        launch.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("flag", ["--port", "--http-port"])
@pytest.mark.parametrize("value", ["-1", "65536", "70000"])
def test_a_port_outside_0_to_65535_is_refused(flag, value, capsys):
    line = _parse_error([flag, value], capsys)
    assert line == (
        f"python launch.py: error: argument {flag}: port must be in 0..65535 (0 = pick a free one), got {int(value)}"
    )


def test_a_port_that_is_no_number_is_refused(capsys):
    assert _parse_error(["--port", "http"], capsys).endswith("argument --port: not a port number: 'http'")


def test_ports_at_the_edges_are_taken():
    args = launch.parse_args(["--port", "0", "--http-port", "65535"])
    assert (args.port, args.http_port) == (0, 65535)
    args = launch.parse_args(["--port", "0", "--http-port", "0"])  # two free ports, picked apart at bind time
    assert (args.port, args.http_port) == (0, 0)


def test_http_port_equal_to_port_is_refused_naming_both(capsys):
    line = _parse_error(["--port", "18557", "--http-port", "18557"], capsys)
    assert line.endswith("argument --http-port: 18557 clashes with --port 18557 (the ZMQ port): pick another")


@pytest.fixture
def no_workers(monkeypatch):
    """main() in this process: no worker may start, and the signal handlers it installs are put back."""

    def refuse(*args, **kw):
        raise AssertionError("a worker group was started")

    monkeypatch.setattr(coordinator.engine, "WorkerGroup", refuse)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in handlers.items():
        signal.signal(s, handler)


@pytest.mark.parametrize(
    "args, line",
    [
        (
            ["--max-model-len", "100000"],
            "error: argument --max-model-len: max_model_len=100000 is longer than the model's limit: "
            "max_position_embeddings=2048 in its config.json; pass max_model_len=2048 or less (or 0 for the model's "
            "limit)",
        ),
        (
            ["--tp", "3"],
            "error: argument --tensor-parallel-size: the model's num_attention_heads=4 is not divisible by "
            "tensor_parallel_size=3 (each rank takes whole attention heads)",
        ),
    ],
)
def test_an_engine_argument_the_model_cannot_take_is_one_line(tiny_tied, no_workers, capsys, args, line):
    code = launch.main(["--model", str(tiny_tied), "--device", "cpu", "--port", "0", *args])
    out = capsys.readouterr()
    assert code == 2 and out.out == ""
    assert out.err.strip() == line
