"""POST /v1/completions: one prompt or several (strings or token ids), n choices each (choice index =
prompt index * n + j), streaming or not, with echo, logprobs (an echoed choice's start with the prompt's, as
vLLM's), vLLM's prompt_logprobs and usage."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace

from starlette.responses import Response

from openai_server.errors import from_engine
from openai_server.logprobs import completion_logprobs, echo_logprobs, prompt_logprobs_json
from openai_server.metrics import TokenTimer
from openai_server.params import (
    check_model,
    choice_params,
    completion_max_tokens,
    completion_prompts,
    sampling_params,
)
from openai_server.responses import engine_errors, finished_response, usage
from openai_server.schemas import CompletionRequest
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

FIELDS = frozenset(CompletionRequest.model_fields) | {"structured_outputs"}  # a compile error names it


async def _echo_texts(state: ServerState, prompts: list) -> list[str]:
    client = state.engine.client
    return [
        p if isinstance(p, str) else await state.engine.control(client.detokenize(p, skip_special_tokens=False))
        for p in prompts
    ]


async def create_completion(state: ServerState, req: CompletionRequest) -> Response:
    arrival = time.monotonic()
    engine = state.engine
    check_model(req.model, engine.served_model_names)
    prompts = completion_prompts(req.prompt)
    defaults = engine.generation_defaults
    score = bool(req.echo) and req.max_tokens == 0  # vLLM's echo without generation: the prompt and its logprobs
    params = sampling_params(req, defaults, 1 if score else completion_max_tokens(req, defaults), req.logprobs)
    jobs = [(p, sp) for p in prompts for sp in choice_params(params, req.n)]
    rid = f"cmpl-{uuid.uuid4().hex}"
    with engine_errors(state, rid, arrival, len(jobs), FIELDS):
        echo = await _echo_texts(state, prompts) if req.echo else None
        if req.stream:
            streams = ChoiceStreams(engine, jobs)
            await streams.start()
            return EventStreamResponse(_events(state, req, rid, streams, echo, arrival, score))
        results = [_unsampled(c) if score else c for c in await generate_all(engine, jobs)]
    choices, num_output = [], 0
    for i, c in enumerate(results):
        first = results[i - i % req.n]  # the prompt's first choice: it computed the prompt logprobs for all
        echoed = echo[i // req.n] if echo else ""
        lp = None
        if echo and req.logprobs is not None:
            prompt_ids, prompt_lps = first.prompt_token_ids, first.prompt_logprobs
            lp = await echo_logprobs(engine, prompt_ids, prompt_lps, c.logprobs, req.logprobs, len(echoed))
        elif req.logprobs is not None and c.logprobs:
            lp, _ = await completion_logprobs(engine, c.logprobs, 0)
        num_output += len(c.token_ids)
        choice = {
            "index": i,
            "text": echoed + c.text,
            "logprobs": lp,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if req.prompt_logprobs is not None:  # vLLM's extra field, only when asked
            choice["prompt_logprobs"] = prompt_logprobs_json(first.prompt_logprobs, req.prompt_logprobs)
        choices.append(choice)
    num_prompt = sum(len(results[k * req.n].prompt_token_ids) for k in range(len(prompts)))
    return finished_response(state, rid, "text_completion", arrival, choices, results, num_prompt, num_output)


def _unsampled(c):
    """A Completion or StepOutput without the one token a prompt-only request generated to compute its logprobs."""
    return replace(
        c, text="", token_ids=[], logprobs=None, finish_reason=c.finish_reason and "length", stop_reason=None
    )


async def _events(
    state: ServerState, req: CompletionRequest, rid: str, streams: ChoiceStreams, echo, arrival, score: bool
):
    engine, n = state.engine, req.n
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": engine.served_model_name}
    count = len(streams.streams)
    timers = [TokenTimer(state.metrics, arrival) for _ in range(count)]
    offsets, outputs, echoed = [0] * count, [0] * count, [echo is None] * count
    reasons: list[str | None] = [None] * count
    prompt_tokens: dict[int, int] = {}
    want_logprobs = req.logprobs is not None
    final_usage, every_usage = usage_events(req.stream_options)
    texts = TextEvents(head, chat=False)
    try:
        async for i, d in streams.deltas():
            d = _unsampled(d) if score else d
            timers[i].tokens(len(d.token_ids))
            outputs[i] += len(d.token_ids)
            if d.num_prompt_tokens:  # every Delta says it: a stream left early still counts its prompt
                prompt_tokens[i // n] = d.num_prompt_tokens
            text = d.text
            if not echoed[i]:  # the prompt goes before the choice's first text
                text, echoed[i] = echo[i // n] + text, True
            lp = None
            if want_logprobs and d.logprobs:
                lp, offsets[i] = await completion_logprobs(engine, d.logprobs, offsets[i])
            if d.finish_reason is not None:
                reasons[i] = d.finish_reason
            elif not text and lp is None and not d.token_ids:
                continue  # no new token; a token whose text is held back still gets its event, as vLLM's
            elif lp is None and not every_usage:  # the common event: a choice's new text
                yield texts.event(i, text)
                continue
            choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": d.finish_reason}
            if d.finish_reason is not None:
                choice["stop_reason"] = d.stop_reason
            chunk = {**head, "choices": [choice]}
            if every_usage:  # this choice's tokens so far, as vLLM's continuous_usage_stats
                chunk["usage"] = usage(prompt_tokens.get(i // n, 0), outputs[i])
            yield sse(chunk)
        if final_usage:
            yield sse({**head, "choices": [], "usage": usage(sum(prompt_tokens.values()), sum(outputs))})
    except Exception as e:  # the engine failed mid-stream: the error is the last event
        yield sse(from_engine(e, FIELDS).body())
    finally:
        final = [r or "abort" for r in reasons]
        state.metrics.finished(rid, arrival, sum(prompt_tokens.values()), sum(outputs), final)
    yield DONE
