"""Tool calling over HTTP (``--enable-auto-tool-choice --tool-call-parser hermes``): the request's tools and an earlier
turn's calls reach the chat template, and the reply passes through the parser. The tiny random model writes no
<tool_call> block, so its replies stay plain content; tests/serving/test_tool_parser.py checks the parser on text that
has calls. A forced call (tool_choice required or a named function) is constrained to the calls' JSON, so there the
tiny model's reply does come back as calls."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from model.tiny import TinySpec, write_tiny_checkpoint
from tests.support.openai_http import HttpServer, http_post
from tests.support.timeouts import HANG_S

NAME = "tiny-tools"
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})
# Qwen's layout, cut down: the tools in a system turn, an assistant's calls as <tool_call> blocks of JSON
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}tool {{ t['function']['name'] }}: "
    "{{ t['function']['description'] }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
MESSAGES = [
    {"role": "user", "content": "weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path: Path = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_tools"), TinySpec(seed=6))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    flags = ["--served-model-name", NAME, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    with HttpServer(path, tmp_path_factory.mktemp("http") / "server.log", *flags) as srv:
        yield srv


@pytest.fixture(scope="module")
def api(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=HANG_S)


def test_tools_and_earlier_calls_reach_the_template(api, server):
    body = {"model": NAME, "messages": MESSAGES, "tools": TOOLS}
    ids = http_post(f"{server.root}/tokenize", json=body).json()["tokens"]
    text = http_post(f"{server.root}/detokenize", json={"model": NAME, "tokens": ids}).json()["prompt"]
    assert "tool get_weather: the weather in a city" in text
    # the earlier call's arguments arrive as the object templates expect, not as OpenAI's JSON text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    reply = api.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=8, **GREEDY)
    assert reply.usage.prompt_tokens == len(ids)
    # no <tool_call> in the tiny model's text: plain content, the same tokens a completion of the prompt gives
    choice = reply.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "length"
    completion = api.completions.create(model=NAME, prompt=ids, max_tokens=8, **GREEDY)
    assert choice.message.content == completion.choices[0].text
    chunks = list(
        api.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=8, stream=True, **GREEDY)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert not any(c.choices[0].delta.tool_calls for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


FORCED_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Rome"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_follows_the_function_schema(api, stream):
    """tool_choice naming a function, on this server and on any other (no parser flag needed): the reply is
    constrained to the function's arguments and comes back as its call."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model=NAME, messages=MESSAGES[:1], tools=FORCED_TOOLS, tool_choice=choice, max_tokens=40, temperature=0)
    if stream:
        chunks = list(api.chat.completions.create(**kw, stream=True))
        calls = [c for ch in chunks if ch.choices for c in ch.choices[0].delta.tool_calls or []]
        assert not any(ch.choices[0].delta.content for ch in chunks if ch.choices)
        finish = chunks[-1].choices[0].finish_reason
    else:
        reply = api.chat.completions.create(**kw)
        calls, finish = reply.choices[0].message.tool_calls, reply.choices[0].finish_reason
        assert reply.choices[0].message.content is None
    assert len(calls) == 1 and calls[0].function.name == "get_weather" and finish == "tool_calls"
    assert json.loads(calls[0].function.arguments)["city"] in ("Paris", "Rome")


def test_tool_choice_required_calls_listed_functions(api):
    reply = api.chat.completions.create(
        model=NAME, messages=MESSAGES[:1], tools=FORCED_TOOLS, tool_choice="required", max_tokens=120, temperature=0
    )
    calls = reply.choices[0].message.tool_calls  # the tiny model's greedy list closes after one call
    assert calls and reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content is None
    for c in calls:
        assert c.function.name in ("get_weather", "get_time")
        assert isinstance(json.loads(c.function.arguments), dict)


def test_a_call_to_an_unknown_function_is_refused_by_name(api):
    with pytest.raises(openai.BadRequestError) as e:
        choice = {"type": "function", "function": {"name": "get_mood"}}
        api.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=4)
    assert e.value.body["param"] == "tool_choice" and "get_mood" in e.value.body["message"]


def test_tool_choice_none_renders_the_tools_but_parses_nothing(api, server):
    body = {"model": NAME, "messages": MESSAGES[:1], "tools": TOOLS}
    ids = http_post(f"{server.root}/tokenize", json=body).json()["tokens"]
    reply = api.chat.completions.create(
        model=NAME, messages=MESSAGES[:1], tools=TOOLS, tool_choice="none", max_tokens=4, **GREEDY
    )
    assert reply.usage.prompt_tokens == len(ids) and reply.choices[0].message.tool_calls is None
    assert json.loads(reply.model_dump_json())["choices"][0]["message"]["content"]
