"""The API key check, as ASGI middleware: it runs on the request's headers alone, so a request without the key is
answered 401 before a byte of its body is read (a route dependency would run only after FastAPI parsed the body)."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from openai_server.errors import APIError

GUARDED_PATHS = ("/tokenize", "/detokenize")  # besides /v1/*; probes (/health, /metrics, /version) stay open


def guarded(path: str) -> bool:
    """Whether ``path`` needs the key: the OpenAI API and the tokenizer routes, as vLLM's --api-key."""
    return path == "/v1" or path.startswith("/v1/") or path in GUARDED_PATHS


class KeyCheck:
    """401 in OpenAI's error shape unless ``Authorization: Bearer KEY`` (compared in constant time)."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self._expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and guarded(scope["path"]):
            given = Headers(scope=scope).get("authorization", "").encode("latin-1")  # as Starlette decoded it
            if not hmac.compare_digest(given, self._expected):
                error = APIError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
