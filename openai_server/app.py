"""The routes: OpenAI's /v1/completions, /v1/chat/completions, /v1/models, /v1/models/{id}; vLLM's /tokenize,
/detokenize, /health, /metrics, /version. /v1/* and the tokenizer routes need the API key when the server has one
(auth.py)."""

from __future__ import annotations

import logging
import time
from importlib import metadata

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from openai_server.auth import KeyCheck
from openai_server.body_limit import BodyLimit
from openai_server.chat import create_chat_completion
from openai_server.completions import create_completion
from openai_server.engine_client import label_requests
from openai_server.error_handlers import ServerErrors, install_error_handlers
from openai_server.errors import APIError, from_engine
from openai_server.json_routes import parse_json_fast
from openai_server.params import GUIDED_FIELDS, check_model, conversation_off_loop
from openai_server.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from openai_server.state import ServerState
from openai_server.streaming import CancelOnDisconnect
from openai_server.text_check import check_request_text

log = logging.getLogger("nanoserve.http")
_warned_fields: set[str] = set()


def _version() -> str:
    try:
        return metadata.version("nanoserve")
    except metadata.PackageNotFoundError:
        return "unknown"


def _warn_unknown_fields(req) -> None:
    new = sorted(set(req.model_extra or ()).difference(_warned_fields, GUIDED_FIELDS))  # those are taken
    if new:
        _warned_fields.update(new)
        log.warning("ignoring request field(s) this server does not know: %s", ", ".join(new))


async def until_disconnect(request: Request, work) -> Response:
    """Await ``work`` unless the client goes away first: then it is cancelled (its requests are aborted)."""
    async with CancelOnDisconnect(request.receive):
        return await work
    return Response(status_code=499)  # nobody is listening


def build_app(state: ServerState, max_body_bytes: int) -> FastAPI:
    """The app; request bodies over ``max_body_bytes`` get a 413."""
    app = FastAPI(title="nanoserve", version=_version(), docs_url=None, redoc_url=None)
    created = int(time.time())  # /v1/models' "created": when this server started serving the model
    engine, key = state.engine, state.api_key

    install_error_handlers(app)
    # the last added runs first: the key, then the body's size, are checked before a byte of the body is read
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if key is not None:
        app.add_middleware(KeyCheck, key=key)
    app.add_middleware(ServerErrors)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        await check_request_text(request, req)
        _warn_unknown_fields(req)
        label_requests(request)
        return await until_disconnect(request, create_completion(state, req))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        await check_request_text(request, req)
        _warn_unknown_fields(req)
        label_requests(request)
        return await until_disconnect(request, create_chat_completion(state, req))

    parse_json_fast(app, "/v1/completions", CompletionRequest, completions)
    parse_json_fast(app, "/v1/chat/completions", ChatCompletionRequest, chat_completions)

    def model_card(name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "nanoserve",
            "root": engine.info["model"],
            "parent": None,
            "max_model_len": engine.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(name) for name in engine.served_model_names]}

    # {model_id:path}: a Hub id's slash (org/name) is part of the id, not a further route segment
    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        check_model(model_id, engine.served_model_names)
        return model_card(model_id)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest, request: Request) -> dict:
        await check_request_text(request, req)
        check_model(req.model, engine.served_model_names)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            prompt = await conversation_off_loop(req)
            add_special = False  # the template's text carries its special tokens
        else:
            prompt, add_special = req.prompt, req.add_special_tokens
        try:
            if req.return_token_strs:  # the vocabulary's spelling, as vLLM's (convert_ids_to_tokens)
                ids, strs = await engine.control(engine.client.token_strings(prompt, add_special))
            else:
                ids, strs = await engine.control(engine.client.tokenize(prompt, add_special)), None
        except Exception as e:
            raise from_engine(
                e, TokenizeRequest.model_fields, "prompt" if req.messages is None else "messages"
            ) from None
        out = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
        if strs is not None:
            out["token_strs"] = strs
        return out

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest, request: Request) -> dict:
        await check_request_text(request, req)
        check_model(req.model, engine.served_model_names)
        try:
            # vLLM decodes with the tokenizer's default: special tokens kept, so tokenize -> detokenize round-trips
            text = await engine.control(engine.client.detokenize(req.tokens, skip_special_tokens=False))
            return {"prompt": text}
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
