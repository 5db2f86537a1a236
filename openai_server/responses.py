"""What /v1/completions and /v1/chat/completions share: the non-streaming response body, its usage block, and
how an engine failure or a client that went away ends a request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager

from starlette.responses import JSONResponse

from openai_server.errors import ABORTS, APIError, from_engine
from openai_server.state import ServerState


@contextmanager
def engine_errors(
    state: ServerState, rid: str, arrival: float, num_choices: int, fields, prompt_param: str = "prompt"
) -> Iterator[None]:
    """Around a request's calls to the engine: its refusals become OpenAI errors (naming the field), and a client
    that went away (until_disconnect cancels the handler; its choices were aborted) or that the server aborted is
    counted as aborted."""
    try:
        yield
    except APIError:
        raise
    except asyncio.CancelledError:
        state.metrics.finished(rid, arrival, 0, 0, ["abort"] * num_choices)
        raise
    except Exception as e:
        if isinstance(e, ABORTS):  # the server aborted it (a shutdown): counted as aborted, answered 503
            state.metrics.finished(rid, arrival, 0, 0, ["abort"] * num_choices)
        raise from_engine(e, fields, prompt_param) from None


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def finished_response(
    state: ServerState,
    rid: str,
    obj: str,
    arrival: float,
    choices: list[dict],
    results: list,
    num_prompt: int,
    num_output: int,
    extra: dict | None = None,
) -> JSONResponse:
    """Records the request's metrics and answers with the whole completion of object type `obj` (and the
    top-level fields in ``extra``, vLLM's additions)."""
    state.metrics.finished(rid, arrival, num_prompt, num_output, [c.finish_reason for c in results])
    body = {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": state.engine.served_model_name,
        "choices": choices,
        "usage": usage(num_prompt, num_output),
        **(extra or {}),
    }
    return JSONResponse(body)
