"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``, with the status codes the
SDKs map to exception classes (400, 401, 404, 413, 429, 503)."""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse

from protocol import errors as _errors
from protocol.codec import ProtocolError
from protocol.errors import EngineDeadError, OverloadedError, RequestError

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
log = logging.getLogger("nanoserve.http")


class AbortedByServer(Exception):
    """A request the server ended with finish_reason "abort" though its HTTP client was still there (the client
    leaving cancels the handler before it could see one): a shutdown's abort, answered as an error, never as a
    200."""


# ours, and the coordinator's Aborted error (a shutdown ended the request, or refused it while draining)
ABORTS = (AbortedByServer, *filter(None, [getattr(_errors, "AbortedError", None)]))


class APIError(Exception):
    """An error answered to the HTTP client; ``param`` names the offending request field when there is one."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, _utf8(message), param and _utf8(param)
        self.logged = False  # a 5xx is logged once, with the traceback of what caused it

    def body(self) -> dict:
        err = {"message": self.message, "type": _TYPES.get(self.status, "Error"), "param": self.param}
        return {"error": {**err, "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _utf8(text: str) -> str:
    """``text`` with lone surrogates (echoed from a request) escaped: the JSON response must encode as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def param_of(message: str, fields, prompt_param: str = "prompt") -> str | None:
    """The request field an error message starts with (SamplingParams and the engine name it first); the engine's
    "prompt" is the request's ``prompt_param`` (chat: "messages")."""
    if "+ max_tokens" in message:  # a prompt that fits, too long with max_tokens: max_tokens is what to lower
        return "max_tokens"
    word = message.split(" ", 1)[0].split("[", 1)[0].split(".", 1)[0].strip("(),:")
    if word == "prompt":
        return prompt_param
    return word if word in fields else None


def log_server_error(error: APIError, cause: BaseException | None, where: str = "") -> None:
    """Log a 5xx once, with the traceback of ``cause`` (what went wrong) or of the error itself."""
    if error.status >= 500 and not error.logged:
        error.logged = True
        log.error("%s%d: %s", f"{where} -> " if where else "", error.status, error.message, exc_info=cause or error)


def from_engine(e: BaseException, fields=(), prompt_param: str = "prompt") -> APIError:
    """The HTTP error for an exception the coordinator's client raised (a refusal too large to send included); a
    5xx is logged here with ``e``'s traceback."""
    error = _from_engine(e, fields, prompt_param)
    log_server_error(error, e)
    return error


def _from_engine(e: BaseException, fields, prompt_param: str) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, ABORTS):
        return APIError(503, f"the request was aborted by the server: {e}")
    if isinstance(e, RequestError):
        return APIError(400, str(e), param_of(str(e), fields, prompt_param))
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
