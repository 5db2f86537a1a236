"""``python -m client [--address tcp://127.0.0.1:8765] "prompt"``: stream a completion to the terminal."""

from __future__ import annotations

import argparse
import sys

from client.client import DEFAULT_ADDRESS, Client
from protocol.codec import ProtocolError
from protocol.errors import EngineDeadError, OverloadedError, RequestError
from protocol.sampling_params import SamplingParams
from settings.env import settings


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
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    p.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling: keep this much probability (default 1.0)"
    )
    p.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens; 0 = all (default 0)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability (default 0)")
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
    try:
        with Client(args.address, timeout=args.timeout, token=args.token) as client:
            with client.stream(" ".join(args.prompt), params) as stream:
                for delta in stream:
                    out.write(delta.text)
                    out.flush()
                    if delta.finish_reason is not None:
                        out.write("\n")
                        print(f"[finish_reason={delta.finish_reason}]", file=sys.stderr)
    except KeyboardInterrupt:
        out.write("\n")
        return 130
    except (RequestError, EngineDeadError, OverloadedError, ProtocolError, TimeoutError) as e:
        print(f"\nerror: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
