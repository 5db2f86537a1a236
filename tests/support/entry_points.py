"""Runs command-line entry points one after another in this one process, as ``python -m MODULE ARGS`` would (torch
is imported once, not once per entry point), and prints one JSON line: for each run its exit status, stdout, stderr
and the argparse parsers it built.

    python -m tests.support.entry_points '[["launch", ["--help"]], ["benchmarks.throughput", ["--help"]]]'
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import runpy
import sys
import traceback


def describe(parser: argparse.ArgumentParser) -> dict:
    return {
        "prog": parser.prog,
        "allow_abbrev": parser.allow_abbrev,
        "without_help": [a.option_strings or [a.dest] for a in parser._actions if not a.help],
    }


def run(module: str, args: list[str]) -> dict:
    parsers: list[argparse.ArgumentParser] = []
    parse_known_args = argparse.ArgumentParser.parse_known_args

    def recording(self, *a, **kw):
        parsers.append(self)
        return parse_known_args(self, *a, **kw)

    out, err, code = io.StringIO(), io.StringIO(), 0
    argv = sys.argv
    argparse.ArgumentParser.parse_known_args = recording
    try:
        sys.argv = [module, *args]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if isinstance(e.code, str):  # what the interpreter does with sys.exit("message")
            err.write(e.code + "\n")
            code = 1
        else:
            code = e.code or 0
    except BaseException:
        err.write(traceback.format_exc())
        code = "exception"
    finally:
        argparse.ArgumentParser.parse_known_args = parse_known_args
        sys.argv = argv
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue(), "parsers": [describe(p) for p in parsers]}


if __name__ == "__main__":
    print(json.dumps([run(module, args) for module, args in json.loads(sys.argv[1])]))
