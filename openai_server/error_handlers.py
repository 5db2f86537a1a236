"""Every error the app answers, in OpenAI's shape (openai_server/errors.py): our own APIErrors, FastAPI's
validation errors (a wrong type, a body that is not JSON) and Starlette's HTTP errors (a body that cannot be parsed,
e.g. JSON nested too deeply for the parser; an unknown route or method; a body over the size cap). Every 5xx is
logged with its traceback, an unexpected exception's included (ServerErrors)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from openai_server.errors import APIError, log_server_error


def _validation_error(e: RequestValidationError) -> APIError:
    errors = e.errors()
    if errors and errors[0].get("type") == "json_invalid":  # not JSON at all: no field to name
        return APIError(400, f"the request body is not valid JSON: {errors[0].get('msg')}", None)
    loc = [str(x) for x in (errors[0].get("loc", ()) if errors else ()) if x != "body"]
    param = loc[0] if loc else None
    # a union field (prompt, stop...) reports one error per member: name the field, list a few
    msgs = list(dict.fromkeys(err.get("msg", "invalid") for err in errors if param in map(str, err.get("loc", ()))))
    what = "; ".join(msgs[:3]) or "invalid request body"
    return APIError(400, f"invalid {param or 'request body'}: {what}", param)


def _http_error(e: HTTPException) -> APIError:
    cause = e.__cause__
    if e.status_code == 400 and cause is not None:  # FastAPI's "error parsing the body": say why
        return APIError(400, f"the request body could not be parsed: {type(cause).__name__}: {cause}", None)
    return APIError(e.status_code, str(e.detail), None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        log_server_error(e, e.__context__, f"{request.method} {request.url.path}")  # 5xx only, once
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        return _validation_error(e).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException) -> JSONResponse:
        response = _http_error(e).response()
        response.headers.update(e.headers or {})  # e.g. a 405's Allow
        return response


class ServerErrors:
    """ASGI middleware around the app: an exception no handler took is logged with its traceback and answered
    500 in OpenAI's shape (Starlette's own answer is plain text, and logged again by uvicorn)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as e:
            error = APIError(500, f"internal error: {type(e).__name__}: {e}")
            log_server_error(error, e, f"{scope.get('method')} {scope.get('path')}")
            if not started:  # else the client sees its response cut short
                await error.response()(scope, receive, send)
