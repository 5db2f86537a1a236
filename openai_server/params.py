"""From an HTTP request to what the coordinator takes: prompts, chat conversations and SamplingParams, with the
model's generation_config.json defaults for the sampling fields a request leaves unset (as vLLM does)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import replace

from client.base import chat_prompt
from openai_server.errors import APIError, param_of
from openai_server.schemas import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from openai_server.tool_parsers import ToolParser, forced_calls
from protocol.chat_content import content_text
from protocol.client_messages import ChatPrompt
from protocol.errors import RequestError
from protocol.sampling_params import MAX_LOGPROBS, SamplingParams, structured_spec

_PARAM_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
# fields whose unset value comes from the model's generation config when it has one
_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# fields sampling_params derives from the request rather than taking as they are
_DERIVED = frozenset({"n", "max_tokens", "logprobs", "logit_bias", "prompt_logprobs", "structured_outputs"})
_SAME_NAMED: dict[type, tuple[str, ...]] = {}
# vLLM's constrained-decoding fields (request extras): each becomes SamplingParams.structured_outputs
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
_GUIDED_KIND = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def check_model(requested: str | None, served: list[str]) -> None:
    if requested is not None and requested not in served:
        raise APIError(404, f"The model `{requested}` does not exist.", "model")


def completion_prompts(prompt) -> list[str | list[int]]:
    """A completions request's prompt field as a list of prompts (strings or token-id lists)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _text(i: int, content) -> str | None:
    try:
        return content_text(content, f"messages[{i}].content")  # the same flattening as LLM.chat's
    except RequestError as e:
        raise APIError(400, str(e), "messages") from None


def conversation(req: ChatCompletionRequest | TokenizeRequest) -> ChatPrompt:
    """The request's messages (text parts joined) and template arguments as the coordinator renders them."""
    out = []
    for i, m in enumerate(req.messages):
        d = m.model_dump(exclude_none=True)
        d["content"] = _text(i, m.content) or ""
        if isinstance(d.get("tool_calls"), list):
            d["tool_calls"] = [_call_for_template(c) for c in d["tool_calls"]]
        out.append(d)
    kwargs = req.chat_template_kwargs
    if req.tools and (kwargs is None or isinstance(kwargs, dict)):  # else the coordinator refuses the kwargs
        kwargs = {**(kwargs or {}), "tools": req.tools}
    try:
        return chat_prompt(out, kwargs, req.add_generation_prompt, req.continue_final_message)
    except RequestError as e:  # its one refusal: continue_final_message with add_generation_prompt
        raise APIError(400, str(e), "continue_final_message") from None


MANY_MESSAGES = 1000  # a conversation this long is flattened in a thread (about 6 us a message, in Python)


async def conversation_off_loop(req: ChatCompletionRequest | TokenizeRequest) -> ChatPrompt:
    """``conversation(req)``; a long one in a worker thread, which lets the event loop run between its bytecodes (a
    7 MB body of 145,000 short messages takes 0.8 s to flatten)."""
    if len(req.messages) < MANY_MESSAGES:
        return conversation(req)
    return await asyncio.to_thread(conversation, req)


def _call_for_template(call):
    """An earlier assistant turn's tool call as chat templates take it: OpenAI sends its arguments as JSON text,
    templates (Qwen's, Llama's) expect the object."""
    fn = call.get("function") if isinstance(call, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            return {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
        except ValueError:
            pass  # left as sent: the template shows the text
    return call


def check_tools(
    req: ChatCompletionRequest, parser: type[ToolParser] | None
) -> tuple[type[ToolParser] | None, dict | None]:
    """The parser of the reply's tool calls and, for a forced call, the structured outputs that force it: with
    tool_choice auto (the default with tools) the server's parser (``parser``, from --tool-call-parser); with
    ``required`` or a named function a constrained reply (any server, as vLLM's); None without tools or with
    ``none``. A 400 naming the field for what cannot be served."""
    choice, tools = req.tool_choice, req.tools
    if choice == "none" or (choice is None and not tools):
        return None, None
    named = isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
    if choice not in (None, "auto", "required") and not (named and isinstance(choice["function"].get("name"), str)):
        raise APIError(400, "tool_choice must be none, auto, required or {'type': 'function', 'function': "
                       "{'name': ...}}", "tool_choice")  # fmt: skip
    if not tools:
        raise APIError(400, f"tool_choice {choice!r} needs tools", "tool_choice")
    if not all(isinstance(t, dict) and isinstance((t.get("function") or {}).get("name"), str) for t in tools):
        raise APIError(400, "tools must be {'type': 'function', 'function': {'name': ...}} objects", "tools")
    if choice not in (None, "auto"):
        if structured_outputs(req) is not None:
            raise APIError(400, "a forced tool call cannot take another constraint (response_format)", "tool_choice")
        try:
            return forced_calls(tools, choice)
        except ValueError as e:
            raise APIError(400, str(e), "tool_choice") from None
    if parser is None:
        raise APIError(
            400, "tools with tool_choice 'auto' need the server started with --enable-auto-tool-choice and "
            "--tool-call-parser", "tools",
        )  # fmt: skip
    return parser, None


def _unsupported(req) -> None:
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of must equal n (or be left out)", "best_of")
        if req.stream and req.echo and req.logprobs is not None:  # the prompt's come with the finished choice
            raise APIError(400, "echo with logprobs is not available when stream=true", "echo")
    if req.stream_options is not None and not req.stream:  # as vLLM: options of a stream there is not
        raise APIError(400, "stream_options can only be given with stream=true", "stream_options")
    if req.stream and req.prompt_logprobs is not None:  # as vLLM: they come with the finished request only
        raise APIError(400, "prompt_logprobs are not available when stream=true", "prompt_logprobs")
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:  # named as sent, not as logprobs
            msg = f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}"
            raise APIError(400, msg, "top_logprobs")


def logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token-id strings -> bias in [-100, 100]) as SamplingParams takes it; a 400 naming the
    field otherwise (ids outside the vocabulary: the engine's RequestError)."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if token < 0:
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        if not -100 <= value <= 100:  # NaN fails too
            raise APIError(400, f"logit_bias values must be in [-100, 100], got {value} for token {key}", "logit_bias")
        out[token] = value
    return out


def structured_outputs(req) -> dict | None:
    """The request's constraint as SamplingParams.structured_outputs: OpenAI's ``response_format`` (``json_object``,
    or ``json_schema`` with its ``schema``) or one of vLLM's GUIDED_FIELDS; None without one, a 400 naming the
    field for a malformed one or for two at once."""
    found: list[tuple[str, dict]] = []
    fmt = req.response_format
    if fmt:
        kind = fmt.get("type")
        if kind == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema") if isinstance(fmt.get("json_schema"), dict) else None
            if not isinstance(schema, dict):
                raise APIError(
                    400, "response_format json_schema needs json_schema.schema (an object)", "response_format"
                )
            found.append(("response_format", {"json": schema}))
        elif kind not in (None, "text"):
            msg = f"response_format type must be text, json_object or json_schema, got {kind!r}"
            raise APIError(400, msg, "response_format")
    extra = req.model_extra or {}
    for name in GUIDED_FIELDS:
        value = extra.get(name)
        if value is not None:
            found.append((name, value if name == "structured_outputs" else {_GUIDED_KIND[name]: value}))
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise APIError(400, f"{names}: give one constraint, not several", found[1][0])
    if not found:
        return None
    name, spec = found[0]
    try:
        structured_spec(spec)
        return spec
    except ValueError as e:
        raise APIError(400, f"{name}: {e}", name) from None


def _same_named(cls: type) -> tuple[str, ...]:
    """The request schema's fields that SamplingParams takes as they are: every field both declare, but those
    ``sampling_params`` derives (n, max_tokens, logprobs...) or defaults from the model (_DEFAULTED). A new
    sampling field declared in the schema under its SamplingParams name needs no line here."""
    names = _SAME_NAMED.get(cls)
    if names is None:
        names = _SAME_NAMED[cls] = tuple(sorted((cls.model_fields.keys() & _PARAM_FIELDS) - _DERIVED - set(_DEFAULTED)))
    return names


def sampling_params(
    req, defaults: dict, max_tokens: int, logprobs: int | None, forced: dict | None = None
) -> SamplingParams:
    """One choice's SamplingParams (n=1: the front-end sends each of a request's n choices on its own);
    ``forced``: the structured outputs of a forced tool call (check_tools). A same-named field left unset (None)
    takes SamplingParams' default; its value is checked by SamplingParams, and a bad one is a 400 naming it."""
    _unsupported(req)
    if not isinstance(req.n, int) or not 1 <= req.n <= 128:
        raise APIError(400, f"n must be an int in [1, 128], got {req.n!r}", "n")
    structured = forced or structured_outputs(req)
    values = {name: v for name in _same_named(type(req)) if (v := getattr(req, name)) is not None}
    for name in _DEFAULTED:
        value = getattr(req, name)
        values[name] = defaults.get(name, getattr(_BASE, name)) if value is None else value
    try:
        return SamplingParams(
            **values,
            max_tokens=max_tokens,
            logprobs=logprobs,
            logit_bias=logit_bias(req.logit_bias),
            prompt_logprobs=_prompt_logprobs(req),
            structured_outputs=structured,
        )
    except (ValueError, TypeError) as e:
        param = param_of(str(e), _PARAM_FIELDS)
        if param == "max_tokens" and getattr(req, "max_completion_tokens", None) is not None:
            param = "max_completion_tokens"  # the field the request used for it
        raise APIError(400, str(e), param) from None


def _prompt_logprobs(req) -> int | None:
    """The top-N prompt logprobs to compute: the request's, or for an echoed completion with logprobs (whose
    prompt tokens show theirs, as vLLM's) at least its ``logprobs``; the responses cut each to what was asked."""
    n = req.prompt_logprobs
    if isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None:
        return req.logprobs if n is None else max(n, req.logprobs)
    return n


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The n choices' params, each sent as its own request (SamplingParams.choices). Prompt logprobs are the
    prompt's, the same for every choice: only the first computes them (the others may then share its prompt's
    KV blocks through the prefix cache) and the response hands them to all."""
    choices = (params if params.n == n else replace(params, n=n)).choices()  # n=1: no second validation
    if params.prompt_logprobs is None or n == 1:
        return choices
    return [choices[0], *(replace(c, prompt_logprobs=None) for c in choices[1:])]


def completion_max_tokens(req: CompletionRequest, defaults: dict) -> int:
    return req.max_tokens if req.max_tokens is not None else defaults.get("max_tokens", 16)


def chat_max_tokens(req: ChatCompletionRequest) -> int | None:
    """The requested limit, or None: then the rest of the context (known once the prompt is tokenized)."""
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


_BASE = SamplingParams()
