"""openai_server/tool_parsers.py: Hermes-style <tool_call> blocks out of a model's text, whole and as it
streams in pieces of any size."""

from __future__ import annotations

import json

import pytest

from openai_server.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    forced_calls,
)

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def names_and_args(calls: list[dict]) -> list[tuple[str, dict]]:
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def streamed(text: str, size: int, parser=HermesToolParser) -> tuple[str, list[dict]]:
    p = parser()
    content, calls = "", []
    for i in range(0, len(text), size):
        c, new = p.feed(text[i : i + size])
        content, calls = content + c, calls + new
    c, new = p.finish()
    assert p.calls == len(calls + new)
    return content + c, calls + new


CASES = [
    # (output text, content, calls)
    ("Paris is sunny.", "Paris is sunny.", []),
    (WEATHER, None, [("get_weather", {"city": "Paris", "unit": "°C"})]),
    (
        "Let me check.\n" + WEATHER + "\n" + TIME,
        "Let me check.",
        [("get_weather", {"city": "Paris", "unit": "°C"}), ("get_time", {})],
    ),  # fmt: skip
    # the output ended inside a block whose JSON is whole (max_tokens, or the end of turn right after it)
    ('<tool_call>\n{"name": "get_time", "arguments": {}}', None, [("get_time", {})]),
    # not a call: text, as written
    ("<tool_call>\n{not json}\n</tool_call> done", "<tool_call>\n{not json}\n</tool_call> done", []),
    ('<tool_call>{"name": "get_ti', '<tool_call>{"name": "get_ti', []),
    ("a < b and <tool_c", "a < b and <tool_c", []),
]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_whole_output(text, content, calls):
    got_content, got_calls = HermesToolParser.extract(text)
    assert got_content == content and names_and_args(got_calls) == calls


@pytest.mark.parametrize("text,content,calls", CASES)
@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_streamed_in_pieces_gives_the_same(text, content, calls, size):
    got_content, got_calls = streamed(text, size)
    assert names_and_args(got_calls) == calls
    # a stream sends content as it comes, the whitespace around the calls too
    assert (got_content.strip() or None) == (content.strip() if content else None)


def test_arguments_given_as_text_or_parameters_are_kept():
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
    text += '<tool_call>{"name": "g", "parameters": {"y": 2}}</tool_call>'
    assert names_and_args(HermesToolParser.extract(text)[1]) == [("f", {"x": 1}), ("g", {"y": 2})]


def test_chat_stream_deltas_number_the_calls():
    from openai_server.chat import _delta

    parser = HermesToolParser()
    pieces = ["Let me check.\n<tool_", "call>\n" + WEATHER[len("<tool_call>\n") :], "\n" + TIME[:-3], TIME[-3:]]
    deltas = [_delta(t, None, parser, final=i == len(pieces) - 1) for i, t in enumerate(pieces)]
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["index"] for c in calls] == [0, 1]
    assert [name for name, _ in names_and_args(calls)] == ["get_weather", "get_time"]
    assert "".join(d.get("content", "") for d in deltas).strip() == "Let me check."


LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
    # kept special tokens show Llama's tag; several calls are joined by ";"
    (
        '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"x": 1}}',
        None,
        [("f", {}), ("g", {"x": 1})],
    ),
    ("Paris is sunny.", "Paris is sunny.", []),
    ("{not a call}", "{not a call}", []),
    ('{"name": "f", "parameters": {}} and then text', '{"name": "f", "parameters": {}} and then text', []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON, but no call
    (" <|python", " <|python", []),
]


MISTRAL_CASES = [
    (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    # with special tokens skipped the list comes alone; two calls
    (' [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"x": 1}}]', None, [("f", {}), ("g", {"x": 1})]),
    ("[1] is a footnote.", "[1] is a footnote.", []),  # held back to the end, then content
    ('[{"name": "f"}, {"no": "name"}]', '[{"name": "f"}, {"no": "name"}]', []),  # not all calls: content
    ("Sunny.", "Sunny.", []),
]


TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "g"}},
]
REQUIRED = forced_calls(TOOLS, "required")[0]
NAMED_G = forced_calls(TOOLS, {"type": "function", "function": {"name": "g"}})[0]
TWO_CALLS = '[{"name": "f", "parameters": {"x": 1}}, {"name": "g", "parameters": {}}]'
FORCED_CASES = [  # replies constrained to the forced calls' JSON (tool_choice required, or the function g)
    (REQUIRED, TWO_CALLS, None, [("f", {"x": 1}), ("g", {})]),
    (REQUIRED, TWO_CALLS[:50], TWO_CALLS[:50], []),  # cut short by max_tokens: content
    (NAMED_G, '{"city": "Paris"}', None, [("g", {"city": "Paris"})]),
    (NAMED_G, '{"city": "Par', '{"city": "Par', []),
]

WHOLE_REPLY_CASES = [(Llama3JsonToolParser, *case) for case in LLAMA_CASES]
WHOLE_REPLY_CASES += [(MistralToolParser, *case) for case in MISTRAL_CASES]
WHOLE_REPLY_CASES += FORCED_CASES


@pytest.mark.parametrize("parser,text,content,calls", WHOLE_REPLY_CASES)
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_whole_reply_parsers_whole_and_streamed(parser, text, content, calls, size):
    got_content, got_calls = parser.extract(text)
    assert got_content == content and names_and_args(got_calls) == calls
    got_content, got_calls = streamed(text, size, parser)
    assert got_content == (content or "") and names_and_args(got_calls) == calls


def test_forced_calls_constrain_to_the_tools_schemas():
    _, named = forced_calls(TOOLS, {"type": "function", "function": {"name": "f"}})
    assert named == {"json": {"type": "object"}}
    _, required = forced_calls(TOOLS, "required")
    items = required["json"]["items"]["anyOf"]
    assert [i["properties"]["name"] for i in items] == [{"enum": ["f"]}, {"enum": ["g"]}]
    assert items[1]["properties"]["parameters"] == {"type": "object"}  # a tool without parameters: any object
    with pytest.raises(ValueError, match="'h'"):
        forced_calls(TOOLS, {"type": "function", "function": {"name": "h"}})
