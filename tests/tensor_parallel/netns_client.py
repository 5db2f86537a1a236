"""A client for test_multihost_netns.py, run inside the coordinator's namespace (its ZMQ port is on that side's
loopback). One JSON line per event on stdout:

    python -m tests.tensor_parallel.netns_client ADDRESS greedy MAX_TOKENS PROMPTS_JSON  -> {"tokens": [[...], ...]}
    python -m tests.tensor_parallel.netns_client ADDRESS stream MAX_TOKENS PROMPT_JSON   -> {"delta": n} per delta,
        then {"finish": reason, "tokens": [...]} or {"error": "Type: message"}

The token comes from $NANOSERVE_API_KEY, as for ``python -m client``."""

from __future__ import annotations

import json
import sys
import time

from client.client import Client
from protocol.sampling_params import SamplingParams
from settings.env import settings


def _say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def main(argv: list[str]) -> int:
    address, mode, max_tokens, prompts = argv[0], argv[1], int(argv[2]), json.loads(argv[3])
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.monotonic()
    try:
        with Client(address, timeout=120, token=settings().api_key) as client:
            if mode == "greedy":
                _say(tokens=[c.token_ids for c in client.generate_many(prompts, params)])
                return 0
            tokens: list[int] = []
            with client.stream(prompts, params) as stream:
                for delta in stream:
                    tokens += delta.token_ids
                    _say(delta=len(tokens), s=round(time.monotonic() - t0, 3))
                    if delta.finish_reason is not None:
                        _say(finish=delta.finish_reason, tokens=tokens)
            return 0
    except Exception as e:  # the test asserts it is a clear one, in bounded time
        _say(error=f"{type(e).__name__}: {e}", s=round(time.monotonic() - t0, 3))
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
