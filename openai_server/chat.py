"""POST /v1/chat/completions: the conversation travels to the coordinator, which renders it with the model's
chat template; n choices, streaming or not, logprobs (bool + top_logprobs), vLLM's prompt_logprobs (once, at the
top level of a non-streaming response), reasoning_content with a reasoning parser, and usage."""

from __future__ import annotations

import time
import uuid

from starlette.responses import Response

from openai_server.errors import from_engine
from openai_server.logprobs import chat_logprobs, prompt_logprobs_json
from openai_server.metrics import TokenTimer
from openai_server.params import (
    chat_max_tokens,
    check_model,
    check_tools,
    choice_params,
    conversation_off_loop,
    sampling_params,
)
from openai_server.responses import engine_errors, finished_response, usage
from openai_server.schemas import ChatCompletionRequest
from openai_server.state import ServerState
from openai_server.streaming import (
    DONE,
    ChoiceStreams,
    EventStreamResponse,
    TextEvents,
    generate_all,
    sse,
    usage_events,
)

FIELDS = frozenset(ChatCompletionRequest.model_fields) | {"structured_outputs"}  # a compile error names it


_TAIL_TOKENS = 16  # a prompt's last tokens, enough to hold "<think>\n" however a tokenizer splits it


async def _prompt_and_opened(state: ServerState, req: ChatCompletionRequest):
    """What to send as the prompt, and whether it leaves a reasoning block open. The coordinator prepares it
    (template, tokenizer, truncation, the room an unset max_tokens takes); only a reasoning parser needs the
    prompt's end here (templates of thinking models open the block), so then it is tokenized first and its ids
    sent, rendered once."""
    chat = await conversation_off_loop(req)
    if state.reasoning_parser is None:
        return chat, False
    engine = state.engine
    ids = await engine.control(engine.client.tokenize(chat, add_special_tokens=False))
    tail = "".join(await engine.token_texts(ids[-_TAIL_TOKENS:]))  # a cut keeps the prompt's end
    return ids, state.reasoning_parser.opens_block(tail)


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest) -> Response:
    arrival = time.monotonic()
    engine = state.engine
    check_model(req.model, engine.served_model_names)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    with engine_errors(state, rid, arrival, req.n, FIELDS, "messages"):
        tools, forced = check_tools(req, state.tool_parser)
        prompt, opened = await _prompt_and_opened(state, req)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        # max_tokens None (unset): the coordinator's room after the prompt, capped by the model's max_new_tokens
        params = sampling_params(req, engine.generation_defaults, chat_max_tokens(req), logprobs, forced)
        jobs = [(prompt, sp) for sp in choice_params(params, req.n)]
        if req.stream:
            streams = ChoiceStreams(engine, jobs)
            await streams.start()
            return EventStreamResponse(_events(state, req, rid, streams, arrival, opened, tools))
        results = await generate_all(engine, jobs)
    choices = []
    for i, c in enumerate(results):
        message = {"role": "assistant", "content": c.text}
        if state.reasoning_parser is not None:
            message["reasoning_content"], message["content"] = state.reasoning_parser.split(c.text, opened)
        finish_reason = c.finish_reason
        if tools is not None and message["content"]:
            content, calls = tools.extract(message["content"])
            if calls:
                message["content"], message["tool_calls"] = content, calls
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        lp = await chat_logprobs(engine, c.logprobs, req.top_logprobs or 0) if req.logprobs and c.logprobs else None
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": lp,
                "finish_reason": finish_reason,
                "stop_reason": c.stop_reason,
            }
        )
    num_prompt, num_output = len(results[0].prompt_token_ids), sum(len(c.token_ids) for c in results)
    extra = None
    if req.prompt_logprobs is not None:  # vLLM's extra field, only when asked; the first choice computed them
        extra = {"prompt_logprobs": prompt_logprobs_json(results[0].prompt_logprobs)}
    return finished_response(state, rid, "chat.completion", arrival, choices, results, num_prompt, num_output, extra)


def _delta(text: str, parser, tools, final: bool) -> dict:
    """The chat delta for new output text: split into reasoning and content by the reasoning parser if there is
    one, then the content's finished tool calls taken out by the tool parser (``tools``) if there is one."""
    if parser is None and tools is None:  # the common case: one dict a token, nothing else
        return {"content": text} if text else {}
    if parser is None:
        reasoning, content = "", text
    else:
        reasoning, content = parser.feed(text)
        if final:
            r2, c2 = parser.finish()
            reasoning, content = reasoning + r2, content + c2
    calls: list[dict] = []
    if tools is not None:
        first = tools.calls
        content, calls = tools.feed(content)
        if final:
            c2, more = tools.finish()
            content, calls = content + c2, calls + more
        calls = [{"index": first + k, **call} for k, call in enumerate(calls)]
    out = {}
    if reasoning:
        out["reasoning_content"] = reasoning
    if content:
        out["content"] = content
    if calls:
        out["tool_calls"] = calls
    return out


async def _events(
    state: ServerState,
    req: ChatCompletionRequest,
    rid: str,
    streams: ChoiceStreams,
    arrival: float,
    opened: bool,
    tools: type | None,
):
    engine = state.engine
    head = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": engine.served_model_name,
    }
    count = len(streams.streams)
    timers = [TokenTimer(state.metrics, arrival) for _ in range(count)]
    parsers = [state.reasoning_parser(opened) if state.reasoning_parser else None for _ in range(count)]
    tool_parsers = [tools() if tools else None for _ in range(count)]
    outputs, started = [0] * count, [False] * count
    reasons: list[str | None] = [None] * count
    num_prompt = 0
    top_n = req.top_logprobs or 0
    final_usage, every_usage = usage_events(req.stream_options)
    texts = TextEvents(head, chat=True)
    try:
        async for i, d in streams.deltas():
            timers[i].tokens(len(d.token_ids))
            outputs[i] += len(d.token_ids)
            num_prompt = d.num_prompt_tokens or num_prompt  # every Delta says it: a stream left early still counts
            final = d.finish_reason is not None
            delta = _delta(d.text, parsers[i], tool_parsers[i], final)
            lp = await chat_logprobs(engine, d.logprobs, top_n) if req.logprobs and d.logprobs else None
            if not started[i]:  # the first event of a choice names the role
                delta, started[i] = {"role": "assistant", "content": "", **delta}, True
            elif not delta and lp is None and not final:
                continue
            elif lp is None and not final and not every_usage and delta.keys() == {"content"}:
                yield texts.event(i, delta["content"])  # the common event: a choice's new text
                continue
            if final:
                reasons[i] = d.finish_reason
            finish_reason = d.finish_reason
            if final and finish_reason == "stop" and tool_parsers[i] is not None and tool_parsers[i].calls:
                finish_reason = "tool_calls"
            choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
            if final:
                choice["stop_reason"] = d.stop_reason
            chunk = {**head, "choices": [choice]}
            if every_usage:  # this choice's tokens so far, as vLLM's continuous_usage_stats
                chunk["usage"] = usage(num_prompt, outputs[i])
            yield sse(chunk)
        if final_usage:
            yield sse({**head, "choices": [], "usage": usage(num_prompt, sum(outputs))})
    except Exception as e:  # the engine failed mid-stream: the error is the last event
        yield sse(from_engine(e, FIELDS, "messages").body())
    finally:
        state.metrics.finished(rid, arrival, num_prompt, sum(outputs), [r or "abort" for r in reasons])
    yield DONE
