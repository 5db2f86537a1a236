"""Serve a model over ZMQ: ``python launch.py`` (no arguments: the embedded default model on
tcp://127.0.0.1:8765); ``--http-port PORT`` adds the OpenAI-compatible HTTP API (a front-end process, see
openai_server/). ``--prompt`` prints completions and exits without serving. Every engine argument
(coordinator/config.py's EngineConfig) is a flag, generated from the dataclass. ``nanoserve serve`` is the same
command with vLLM's port names (nanoserve/cli.py); both share nanoserve/serve_args.py's parser and
nanoserve/serve.py. See docs/SERVING.md."""

from __future__ import annotations

import sys

from nanoserve.serve import main
from nanoserve.serve_args import build_parser, parse_args, port_number

__all__ = ["main", "build_parser", "parse_args", "port_number"]  # what tests and scripts import from here

if __name__ == "__main__":
    sys.exit(main())
