"""``python -m client [--address tcp://127.0.0.1:8765] "prompt"``: stream a completion to the terminal."""

from __future__ import annotations

import argparse
import socket
import sys

from client.client import DEFAULT_ADDRESS, Client
from client.liveness import DEFAULT_CONNECT_TIMEOUT_S
from protocol.codec import ProtocolError
from protocol.errors import EngineDeadError, OverloadedError, RequestError
from protocol.sampling_params import SamplingParams
from settings.env import settings


def refused(address: str, timeout: float) -> bool:
    """Whether a TCP ``address`` refuses connections (nothing listens there): said at once, where ZMQ would retry
    silently until the connect timeout. Anything else (a slow host, ipc://) is left to the client's own wait."""
    scheme, _, rest = address.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme != "tcp" or not port.isdigit() or host in ("", "*"):
        return False
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        pass
    return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m client", description="Stream a completion from a nanoserve server.", allow_abbrev=False
    )
    p.add_argument("prompt", nargs="+", help="the prompt (several words are joined with spaces)")
    p.add_argument(
        "--address",
        default=settings().address or DEFAULT_ADDRESS,
        help=f"the server's ZMQ address (default: $NANOSERVE_ADDRESS or {DEFAULT_ADDRESS})",
    )
    p.add_argument(
        "--token", default=settings().api_key, help="the server's shared secret (default: $NANOSERVE_API_KEY)"
    )
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for each reply (default 60)")
    sp = SamplingParams()  # its defaults are vLLM's, so launch.py --prompt and LLM.generate sample alike
    p.add_argument(
        "--max-tokens", type=int, default=sp.max_tokens, help=f"tokens to generate at most (default {sp.max_tokens})"
    )
    p.add_argument("--temperature", type=float, default=sp.temperature, help=f"0 = greedy (default {sp.temperature:g})")
    p.add_argument(
        "--top-p",
        type=float,
        default=sp.top_p,
        help=f"nucleus sampling: keep this much probability (default {sp.top_p:g})",
    )
    p.add_argument(
        "--top-k", type=int, default=sp.top_k, help=f"keep the k likeliest tokens; 0 = all (default {sp.top_k})"
    )
    p.add_argument(
        "--min-p",
        type=float,
        default=sp.min_p,
        help=f"drop tokens below min_p x the top probability (default {sp.min_p:g})",
    )
    p.add_argument("--seed", type=int, default=None, help="seed of this request's sampling (default: none)")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    args = p.parse_args(argv)
    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            max_tokens=args.max_tokens,
            stop=args.stop,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
        )
    except ValueError as e:
        p.error(str(e))
    out = sys.stdout
    connect_timeout = min(args.timeout, DEFAULT_CONNECT_TIMEOUT_S)  # no server: said within --timeout
    if refused(args.address, connect_timeout):
        print(
            f"error: no server at {args.address} (connection refused); start one with: python launch.py",
            file=sys.stderr,
        )
        return 1
    streamed = False  # an error after some text ends its line first
    try:
        with Client(args.address, timeout=args.timeout, token=args.token, connect_timeout=connect_timeout) as client:
            with client.stream(" ".join(args.prompt), params) as stream:
                for delta in stream:
                    out.write(delta.text)
                    out.flush()
                    streamed = True
                    if delta.finish_reason is not None:
                        out.write("\n")
                        print(f"[finish_reason={delta.finish_reason}]", file=sys.stderr)
    except KeyboardInterrupt:
        out.write("\n")
        return 130
    except (RequestError, EngineDeadError, OverloadedError, ProtocolError, TimeoutError, ConnectionError) as e:
        if streamed:
            out.write("\n")
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
