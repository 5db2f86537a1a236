"""The shared --log-level flag of launch.py and the OpenAI front-end: case-insensitive, checked, INFO by default."""

from __future__ import annotations

import argparse

import pytest

import launch
from openai_server.__main__ import build_parser as openai_parser


@pytest.mark.parametrize("build", [launch.build_parser, openai_parser])
def test_log_level_flag(build, capsys):
    parser: argparse.ArgumentParser = build()
    assert parser.parse_args([]).log_level == "INFO"
    assert parser.parse_args(["--log-level", "debug"]).log_level == "DEBUG"
    with pytest.raises(SystemExit):
        parser.parse_args(["--log-level", "loud"])
    assert "--log-level" in capsys.readouterr().err
