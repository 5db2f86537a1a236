"""The non-streaming response body shared by /v1/completions and /v1/chat/completions, and its usage block."""

from __future__ import annotations

import time

from starlette.responses import JSONResponse

from client.openai_server.state import ServerState


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
