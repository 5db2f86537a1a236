"""Pieces of the HTTP front-end on their own: the Qwen3 reasoning parser over every way of cutting a stream, a
chat prompt travelling inside Generate's untyped prompt field, per-choice seeds, the fields refused and an SSE
event's line breaks."""

from __future__ import annotations

import json

import msgpack
import pytest

from client.base import _generate_msg, chat_prompt
from openai_server.errors import APIError
from openai_server.params import check_tools, choice_params, sampling_params
from openai_server.reasoning import Qwen3ReasoningParser
from openai_server.schemas import ChatCompletionRequest, CompletionRequest
from openai_server.streaming import sse
from openai_server.tool_parsers import HermesToolParser
from protocol.client_messages import CLIENT_PROTOCOL_VERSION, ChatPrompt, Generate, Tokenize
from protocol.codec import ProtocolError, decode, encode
from protocol.sampling_params import SamplingParams

OUTPUTS = [  # (output, the prompt opened the block, reasoning, content)
    ("<think>\nlet me see</think>\n\nThe answer is 4.", False, "\nlet me see", "\n\nThe answer is 4."),
    ("  <think>a < b</thi</think>done", False, "a < b</thi", "done"),
    ("No thinking here, <think> later is content", False, None, "No thinking here, <think> later is content"),
    ("<think>cut off mid-thought", False, "cut off mid-thought", None),  # no content: None, as vLLM
    ("<thin", False, None, "<thin"),
    ("", False, None, ""),
    ("\nlet me see</think>\n\n4.", True, "\nlet me see", "\n\n4."),  # thinking templates end the prompt in <think>
    ("still thinking <thin", True, "still thinking <thin", None),
]


@pytest.mark.parametrize("text,opened,reasoning,content", OUTPUTS)
def test_qwen3_reasoning_parser_any_chunking(text, opened, reasoning, content):
    assert Qwen3ReasoningParser.split(text, opened) == (reasoning, content)
    for step in range(1, len(text) + 1):  # every chunk size, so tags split at every position
        p = Qwen3ReasoningParser(opened)
        parts = [p.feed(text[i : i + step]) for i in range(0, len(text), step)] + [p.finish()]
        assert "".join(r for r, _ in parts) == (reasoning or "")
        assert "".join(c for _, c in parts) == (content or "")
        assert not any(Qwen3ReasoningParser.START in r or Qwen3ReasoningParser.END in r for r, _ in parts)


def test_qwen3_reasoning_block_opened_by_the_prompt():
    opens = Qwen3ReasoningParser.opens_block
    assert opens("<|im_start|>assistant\n<think>\n") and opens("<think>")
    assert not opens("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking false closes it
    assert not opens("<|im_start|>assistant\n") and not opens("")


def test_chat_prompt_travels_in_generate():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo", "name": "bob"}]
    msg = _generate_msg("r1", None, chat_prompt(messages, {"enable_thinking": False}), SamplingParams(), True)
    back = decode(encode(msg))
    assert isinstance(back, Generate) and back.prompt == ChatPrompt(messages, {"enable_thinking": False}, True)
    # a record that does not decode inside the untyped field is refused, naming the field
    raw = msgpack.unpackb(encode(msg), raw=False)
    raw[4] = msgpack.ExtType(1, msgpack.packb([45, "not a list of messages"]))
    with pytest.raises(ProtocolError, match="ChatPrompt: expected 3 fields"):
        decode(msgpack.packb(raw, use_bin_type=True))
    raw[4] = msgpack.ExtType(1, b"\xc1")  # msgpack's never-used byte
    with pytest.raises(ProtocolError, match="Generate.prompt: undecodable record"):
        decode(msgpack.packb(raw, use_bin_type=True))


def test_chat_prompt_travels_in_tokenize():
    """Tokenize has only untyped and scalar fields: the record inside still travels as ext, not as a raw object."""
    chat = chat_prompt([{"role": "user", "content": "hi"}])
    msg = Tokenize(CLIENT_PROTOCOL_VERSION, "t1", None, chat, True)
    assert decode(encode(msg)) == msg
    assert decode(encode(Tokenize(CLIENT_PROTOCOL_VERSION, "t2", "key", "plain text", False))).prompt == "plain text"


def test_each_seeded_choice_gets_its_own_seed():
    base = SamplingParams(seed=7, temperature=1.0)
    assert [p.seed for p in choice_params(base, 3)] == [7, 8, 9]
    assert choice_params(SamplingParams(), 2) == [SamplingParams(), SamplingParams()]
    assert [p.seed for p in choice_params(SamplingParams(seed=2**63 - 1), 2)] == [2**63 - 1, 0]
    # LLM.generate fans out the same way: n requests of n=1
    assert [(p.n, p.seed) for p in SamplingParams(n=3, seed=7).choices()] == [(1, 7), (1, 8), (1, 9)]
    assert SamplingParams(n=2).choices() == [SamplingParams(), SamplingParams()]


CHAT = {"messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize(
    "request_type, body, param",
    [
        (CompletionRequest, {"prompt": "x", "suffix": "y"}, "suffix"),
        (CompletionRequest, {"prompt": "x", "response_format": {"type": "xml"}}, "response_format"),
        (ChatCompletionRequest, {**CHAT, "response_format": {"type": "json_schema"}}, "response_format"),  # no schema
        (CompletionRequest, {"prompt": "x", "guided_json": "{not json"}, "guided_json"),
        (ChatCompletionRequest, {**CHAT, "guided_choice": []}, "guided_choice"),
        (ChatCompletionRequest, {**CHAT, "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        (
            ChatCompletionRequest,
            {**CHAT, "response_format": {"type": "json_object"}, "guided_regex": "a"},
            "guided_regex",
        ),
    ],
)
def test_what_would_change_the_output_unseen_is_refused(request_type, body, param):
    """Fields the server cannot honour (suffix, a malformed or doubled constraint) are a 400 naming the field, not
    silently dropped as other unknown fields are; {"type": "text"} and absent constraints pass."""
    with pytest.raises(APIError) as e:
        sampling_params(request_type(**body), {}, 4, None)
    assert e.value.status == 400 and e.value.param == param
    plain = {k: v for k, v in body.items() if k in ("prompt", "messages")}
    params = sampling_params(request_type(**plain, response_format={"type": "text"}, guided_json=None), {}, 4, None)
    assert params.structured_outputs is None


@pytest.mark.parametrize(
    "extra, spec",
    [
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}},
         {"json": {"type": "object"}}),
        ({"guided_json": '{"type": "integer"}'}, {"json": {"type": "integer"}}),
        ({"guided_regex": "a+"}, {"regex": "a+"}),
        ({"guided_choice": ["a", "b"]}, {"choice": ["a", "b"]}),
        ({"guided_grammar": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}),
        ({"structured_outputs": {"choice": ["a"]}}, {"choice": ["a"]}),
    ],
)  # fmt: skip
def test_each_constraint_field_becomes_structured_outputs(extra, spec):
    """OpenAI's response_format and vLLM's guided_* / structured_outputs fields, as SamplingParams carries them."""
    params = sampling_params(ChatCompletionRequest(**CHAT, **extra), {}, 4, None)
    assert json.loads(params.structured_outputs) == spec


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
NAMED = {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize(
    "body, parser, param",
    [
        ({**CHAT, "tools": TOOLS}, None, "tools"),  # tool_choice auto by default: the server needs its parser
        ({**CHAT, "tool_choice": "auto"}, HermesToolParser, "tool_choice"),  # auto, and no tools
        ({**CHAT, "tool_choice": "required"}, None, "tool_choice"),
        ({**CHAT, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}}, None, "tool_choice"),
        ({**CHAT, "tools": TOOLS, "tool_choice": "always"}, None, "tool_choice"),
        ({**CHAT, "tools": [{"type": "function"}], "tool_choice": "required"}, None, "tools"),
        (
            {**CHAT, "tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}},
            None,
            "tool_choice",
        ),
    ],
)
def test_tool_requests_that_cannot_be_served_are_refused_by_name(body, parser, param):
    with pytest.raises(APIError) as e:
        check_tools(ChatCompletionRequest(**body), parser)
    assert e.value.status == 400 and e.value.param == param


def test_auto_takes_the_servers_parser_and_a_forced_call_a_constraint():
    assert check_tools(ChatCompletionRequest(**CHAT, tools=TOOLS), HermesToolParser) == (HermesToolParser, None)
    assert check_tools(ChatCompletionRequest(**CHAT, tools=TOOLS, tool_choice="none"), None) == (None, None)
    assert check_tools(ChatCompletionRequest(**CHAT), None) == (None, None)
    parser, spec = check_tools(ChatCompletionRequest(**CHAT, tools=TOOLS, tool_choice=NAMED), None)  # no flags needed
    assert spec == {"json": {"type": "object"}} and parser.extract('{"x": 1}')[1][0]["function"]["name"] == "f"
    parser, spec = check_tools(ChatCompletionRequest(**CHAT, tools=TOOLS, tool_choice="required"), None)
    assert spec["json"]["type"] == "array" and spec["json"]["minItems"] == 1
    params = sampling_params(ChatCompletionRequest(**CHAT, tools=TOOLS, tool_choice="required"), {}, 4, None, spec)
    assert json.loads(params.structured_outputs) == spec


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("inherited", [False, True])
def test_http_connections_have_nagle_off(inherited, loop):
    """The front-end's listening socket (its own, or one launch.py bound and passed down) reads as TCP, so asyncio
    sets TCP_NODELAY on every connection; else a streamed event can wait ~40 ms for the client's delayed ACK."""
    import argparse
    import asyncio
    import socket

    from openai_server.__main__ import _listen_socket

    parent = socket.create_server(("127.0.0.1", 0)) if inherited else None
    args = argparse.Namespace(fd=parent.detach() if inherited else None, host="127.0.0.1", port=0)
    sock = _listen_socket(args)

    async def nodelay_of_accepted() -> int:
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()

        class Grab(asyncio.Protocol):
            def connection_made(self, transport):
                accepted.set_result(transport.get_extra_info("socket"))

        server = await asyncio.get_running_loop().create_server(Grab, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        conn = await asyncio.wait_for(accepted, 10)
        flag = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        writer.close()
        server.close()
        return flag

    run = pytest.importorskip("uvloop").run if loop == "uvloop" else asyncio.run  # the front-end's loop if installed
    assert run(nodelay_of_accepted()) != 0


def test_an_event_is_one_line_to_any_line_splitter():
    # JSON may carry NEL, U+2028 and U+2029 raw; httpx's iter_lines (str.splitlines) would cut the event there
    payload = {"choices": [{"text": "a\x85b\u2028c\u2029d\ne\r\x1cf é 字"}]}
    event = sse(payload)
    line, end = event.decode().splitlines()
    assert end == "" and event.endswith(b"\n\n") and json.loads(line.removeprefix("data: ")) == payload
    assert "é 字" in line  # other text stays as it is, not escaped


def test_an_unexpected_exception_is_a_logged_500_in_openai_shape(caplog):
    """An exception no handler takes (a bug) is answered 500 in OpenAI's shape, not Starlette's plain text, and
    logged once with its traceback; the app's own 5xx (an APIError) are logged with theirs too."""
    import asyncio

    import httpx
    from fastapi import FastAPI

    from openai_server.error_handlers import ServerErrors, install_error_handlers

    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(ServerErrors)

    @app.get("/bug")
    async def bug() -> dict:
        return {"x": 1 // 0}

    @app.get("/dead")
    async def dead() -> dict:
        try:
            raise ConnectionError("the socket broke")
        except ConnectionError:
            raise APIError(503, "the engine is unreachable") from None

    async def ask() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [await client.get("/bug"), await client.get("/dead")]

    with caplog.at_level("ERROR", logger="nanoserve.http"):
        bug_r, dead_r = asyncio.run(ask())
    assert bug_r.status_code == 500 and bug_r.json()["error"]["type"] == "InternalServerError"
    assert "ZeroDivisionError" in bug_r.json()["error"]["message"]
    assert dead_r.status_code == 503 and dead_r.json()["error"]["code"] == 503
    records = [r for r in caplog.records if r.name == "nanoserve.http"]
    assert [r.exc_info[0] for r in records] == [ZeroDivisionError, ConnectionError], records
    assert "GET /bug -> 500" in records[0].getMessage() and "GET /dead -> 503" in records[1].getMessage()


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", 2**64),
        ("max_tokens", 2**63),
        ("top_k", 2**63),
        ("min_tokens", 2**64),
        ("seed", -(2**63) - 1),
        ("truncate_prompt_tokens", 2**70),
        ("stop_token_ids", [1, 2**64]),
        ("logit_bias", {2**64: 1.0}),
    ],
)
def test_sampling_params_refuse_integers_the_wire_cannot_carry(field, value):
    """Every client (offline LLM, ZMQ, HTTP) builds SamplingParams: an int outside the signed 64-bit range is a
    ValueError naming the field there, before msgpack (which packs nothing from 2**64) or the engine sees it."""
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**{field: value})
    edge = 2**63 - 1  # the largest that travels
    sp = SamplingParams(max_tokens=edge, top_k=edge, seed=edge, stop_token_ids=[edge], logit_bias={edge: 1.0})
    msg = Generate(CLIENT_PROTOCOL_VERSION, "r", None, "x", False, sp)
    assert decode(encode(msg)).params == sp
