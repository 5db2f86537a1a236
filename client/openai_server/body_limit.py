"""A cap on HTTP request bodies (ASGI middleware), so that one client cannot make the front-end buffer and parse
an unbounded body: past ``max_bytes`` the request gets a 413 in OpenAI's error shape. A declared Content-Length
over the cap is refused before any of the body is read; a chunked body is counted as it arrives."""

from __future__ import annotations

from fastapi.exceptions import HTTPException
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from client.openai_server.errors import APIError

BODIES_PER_MESSAGE = 8  # default cap: a body holds several prompts (JSON-escaped) for the coordinator's messages


def _message(max_bytes: int) -> str:
    return f"the request body is over the server's limit of {max_bytes} bytes"


class BodyTooLarge(HTTPException):
    """Raised from the body's reader: FastAPI passes HTTPExceptions through its body parsing to the handlers."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, _message(max_bytes))


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            await APIError(413, _message(self.max_bytes)).response()(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counted, send)
