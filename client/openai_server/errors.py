"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``, with the status codes the
SDKs map to exception classes (400, 401, 404, 429, 503)."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from protocol.codec import ProtocolError
from protocol.errors import EngineDeadError, OverloadedError, RequestError

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error answered to the HTTP client; ``param`` names the offending request field when there is one."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        err = {"message": self.message, "type": _TYPES.get(self.status, "Error"), "param": self.param}
        return {"error": {**err, "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def param_of(message: str, fields) -> str | None:
    """The request field an error message starts with (SamplingParams and the engine name it first)."""
    if "+ max_tokens" in message:  # prompt + max_tokens over the context: max_tokens is what to lower
        return "max_tokens"
    word = message.split(" ", 1)[0].split("[", 1)[0].strip("(),:")
    return word if word in fields else None


def from_engine(e: BaseException, fields=()) -> APIError:
    """The HTTP error for an exception the coordinator's client raised."""
    if isinstance(e, RequestError):
        return APIError(400, str(e), param_of(str(e), fields))
    if isinstance(e, OverloadedError):
        return APIError(429, str(e))
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e))
    if isinstance(e, TimeoutError):
        return APIError(503, f"the engine did not answer in time: {e}")
    if isinstance(e, ConnectionError):
        return APIError(503, f"the engine is unreachable: {e}")
    if isinstance(e, ProtocolError):
        return APIError(500, f"the engine refused the request: {e}")
    return APIError(500, f"{type(e).__name__}: {e}")
