"""The routes: OpenAI's /v1/completions, /v1/chat/completions, /v1/models; vLLM's /tokenize, /detokenize,
/health, /metrics, /version. /v1/* and the tokenizer routes need the API key when the server has one."""

from __future__ import annotations

import asyncio
import hmac
import logging
from importlib import metadata

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import JSONResponse, Response

from client.openai_server.chat import create_chat_completion
from client.openai_server.completions import create_completion
from client.openai_server.errors import APIError, from_engine
from client.openai_server.params import GUIDED_FIELDS, check_model, conversation
from client.openai_server.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from client.openai_server.state import ServerState

log = logging.getLogger("nanoserve.http")
_warned_fields: set[str] = set()


def _version() -> str:
    try:
        return metadata.version("nanoserve")
    except metadata.PackageNotFoundError:
        return "unknown"


def _warn_unknown_fields(req) -> None:
    new = sorted(set(req.model_extra or ()).difference(_warned_fields, GUIDED_FIELDS))  # those are refused instead
    if new:
        _warned_fields.update(new)
        log.warning("ignoring request field(s) this server does not know: %s", ", ".join(new))


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work) -> Response:
    """Run ``work`` unless the client goes away first; then it is cancelled (its requests are aborted)."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
    if task.cancelled():
        return Response(status_code=499)  # nobody is listening
    return task.result()


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="nanoserve", version=_version(), docs_url=None, redoc_url=None)
    engine, key = state.engine, state.api_key

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        if errors and errors[0].get("type") == "json_invalid":  # not JSON at all: no field to name
            return APIError(400, f"the request body is not valid JSON: {errors[0].get('msg')}", None).response()
        loc = [str(x) for x in (errors[0].get("loc", ()) if errors else ()) if x != "body"]
        param = loc[0] if loc else None
        # a union field (prompt, stop...) reports one error per member: name the field, list a few
        msgs = list(dict.fromkeys(err.get("msg", "invalid") for err in errors if param in map(str, err.get("loc", ()))))
        what = "; ".join(msgs[:3]) or "invalid request body"
        return APIError(400, f"invalid {param or 'request body'}: {what}", param).response()

    async def authorized(request: Request) -> None:
        if key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')")

    guarded = [Depends(authorized)]

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(req: CompletionRequest, request: Request) -> Response:
        _warn_unknown_fields(req)
        return await until_disconnect(request, create_completion(state, req))

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        _warn_unknown_fields(req)
        return await until_disconnect(request, create_chat_completion(state, req))

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> dict:
        card = {
            "id": engine.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "nanoserve",
            "root": engine.info["model"],
            "parent": None,
            "max_model_len": engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/tokenize", dependencies=guarded)
    async def tokenize(req: TokenizeRequest) -> dict:
        check_model(req.model, engine.served_model_name)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            prompt = conversation(req.messages, req.chat_template_kwargs, req.add_generation_prompt)
            add_special = False  # the template's text carries its special tokens
        else:
            prompt, add_special = req.prompt, req.add_special_tokens
        try:
            ids = await engine.control(engine.client.tokenize(prompt, add_special))
            strs = await engine.token_texts(ids) if req.return_token_strs else None
        except Exception as e:
            raise from_engine(e, TokenizeRequest.model_fields) from None
        out = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
        if strs is not None:
            out["token_strs"] = strs
        return out

    @app.post("/detokenize", dependencies=guarded)
    async def detokenize(req: DetokenizeRequest) -> dict:
        check_model(req.model, engine.served_model_name)
        try:
            return {"prompt": await engine.control(engine.client.detokenize(req.tokens))}
        except Exception as e:
            raise from_engine(e, DetokenizeRequest.model_fields) from None

    @app.get("/health")
    async def health() -> Response:
        try:
            h = await engine.control(engine.client.health())
        except Exception as e:
            raise APIError(503, f"the engine does not answer: {type(e).__name__}: {e}") from None
        if not h["healthy"]:
            raise APIError(503, f"the engine is dead: {h['message']}")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            stats = await engine.control(engine.client.stats())
        except Exception:  # the front-end's own metrics still answer
            stats = None
        return Response(state.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict:
        return {"version": _version()}

    return app
