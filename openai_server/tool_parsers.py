"""Tool-call parsers: find the calls a model writes into its output text and return them as OpenAI ``tool_calls``,
as the output streams (vLLM's ``--tool-call-parser`` names). ``hermes``: ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` blocks, as Hermes, Qwen2.5 and Qwen3 write them. ``llama3_json``: the whole reply a JSON object
``{"name": ..., "parameters": {...}}`` (or several joined by ``;``), as Llama 3.1-3.3 write them. ``mistral``: the
whole reply a JSON list of calls, as Mistral's instruct models write them after ``[TOOL_CALLS]``. A forced call
(``tool_choice`` ``required`` or a named function) needs no parser flag: structured outputs constrain the reply
to the calls' JSON (``forced_calls``), which ``ForcedCallsParser`` reads back as calls."""

from __future__ import annotations

import json
import uuid

from openai_server.reasoning import partial_tag_suffix


def tool_call(name: str, arguments: str) -> dict:
    """An OpenAI tool call with a fresh id; ``arguments`` is the JSON text of the arguments object."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


class ToolParser:
    """``feed`` pieces of output, then ``finish``; each returns (content, finished calls). ``calls`` counts the
    calls returned so far: the next one's index in a stream."""

    def __init__(self) -> None:
        self.held = ""  # text not yet returned
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """The content and the calls completed by the next piece of output."""
        content, calls = self._feed(text)
        self.calls += len(calls)
        return content, calls

    def finish(self) -> tuple[str, list[dict]]:
        """What was held back, once the output is complete."""
        content, calls = self._finish()
        self.calls += len(calls)
        return content, calls

    @classmethod
    def extract(cls, text: str) -> tuple[str | None, list[dict]]:
        """A whole output's content (None when only calls and whitespace are left, as vLLM) and calls."""
        p = cls()
        c1, calls = p.feed(text)
        c2, more = p.finish()
        content = c1 + c2
        if calls or more:
            return (content.strip() or None), calls + more
        return content, []

    def _feed(self, text: str) -> tuple[str, list[dict]]:
        raise NotImplementedError

    def _finish(self) -> tuple[str, list[dict]]:
        raise NotImplementedError


class HermesToolParser(ToolParser):
    """Text outside ``<tool_call>`` blocks is content; each block's JSON becomes a call. A block still open when
    the output ends (max_tokens, or the end-of-turn token right after its JSON) is a call if its JSON parses, and
    content otherwise, as is a block whose JSON is not a call. Text that may be the start of a tag is held back
    until it is not."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self.in_call = False  # ``held`` is then the open block's text

    def _feed(self, text: str) -> tuple[str, list[dict]]:
        self.held += text
        content, calls = "", []
        while True:
            if self.in_call:
                end = self.held.find(self.END)
                if end < 0:
                    return content, calls
                block, self.held, self.in_call = self.held[:end], self.held[end + len(self.END) :], False
                call = _parse(block)
                if call is None:
                    content += self.START + block + self.END
                else:
                    calls.append(call)
                continue
            start = self.held.find(self.START)
            if start < 0:
                keep = partial_tag_suffix(self.held, self.START)
                ready, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
                return content + ready, calls
            content += self.held[:start]
            self.held, self.in_call = self.held[start + len(self.START) :], True

    def _finish(self) -> tuple[str, list[dict]]:
        held, self.held = self.held, ""
        if not self.in_call:
            return held, []
        self.in_call, call = False, _parse(held)
        return (self.START + held, []) if call is None else ("", [call])


class WholeReplyToolParser(ToolParser):
    """Calls that are the whole reply: one that starts with ``OPENER`` (after whitespace, or after ``TAG``, the
    model's call token, when special tokens are kept) is held back to its end, then is calls if ``calls_of`` reads
    all of it, and content otherwise; any other reply is content as it streams."""

    TAG, OPENER = "", ""

    def __init__(self) -> None:
        super().__init__()
        self.state = "start"  # start -> call (held to the end) or start -> content

    def _feed(self, text: str) -> tuple[str, list[dict]]:
        if self.state == "content":
            return text, []
        self.held += text
        head = self.held.lstrip()
        if self.state == "start" and head:
            if head.startswith((self.OPENER, self.TAG)):
                self.state = "call"
            elif not self.TAG.startswith(head):  # not the tag's start either: content from here on
                self.state, held, self.held = "content", self.held, ""
                return held, []
        return "", []

    def _finish(self) -> tuple[str, list[dict]]:
        held, self.held = self.held, ""
        calls = self.calls_of(held.lstrip().removeprefix(self.TAG)) if self.state == "call" else None
        return ("", calls) if calls else (held, [])

    @staticmethod
    def calls_of(text: str) -> list[dict] | None:
        raise NotImplementedError


class Llama3JsonToolParser(WholeReplyToolParser):
    """Llama 3.1-3.3: ``{"name": ..., "parameters": {...}}`` objects joined by ``;``, after ``<|python_tag|>``."""

    TAG, OPENER = "<|python_tag|>", "{"

    @staticmethod
    def calls_of(text: str) -> list[dict] | None:
        return _parse_joined(text)


class MistralToolParser(WholeReplyToolParser):
    """Mistral's instruct models: a JSON list of ``{"name": ..., "arguments": {...}}`` after ``[TOOL_CALLS]``."""

    TAG, OPENER = "[TOOL_CALLS]", "["

    @staticmethod
    def calls_of(text: str) -> list[dict] | None:
        try:
            items = json.loads(text)
        except ValueError:
            return None
        calls = [_call(item) for item in items] if isinstance(items, list) else [_call(items)]
        return calls if calls and all(calls) else None


def _parse_joined(text: str) -> list[dict] | None:
    """The calls of ``text`` if it is nothing but call objects joined by ``;`` (and whitespace), else None."""
    decoder, calls, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or (calls and text[i] == ";")):
            i += 1
        if i == len(text):
            return calls or None
        try:
            obj, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        call = _call(obj)
        if call is None:
            return None
        calls.append(call)


def _parse(block: str) -> dict | None:
    """The call a block's JSON names, or None."""
    try:
        return _call(json.loads(block))
    except ValueError:
        return None


def _call(obj) -> dict | None:
    """The call a JSON value names ({"name": str, "arguments" or "parameters": object or JSON text}), or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return tool_call(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class ForcedCallsParser(ToolParser):
    """A reply constrained to the forced calls' JSON: for a named function (``NAME``), its arguments object; for
    ``required``, a list of ``{"name", "parameters"}``. Held back whole, then calls; a reply cut short (its JSON
    incomplete) stays content."""

    NAME: str | None = None

    def _feed(self, text: str) -> tuple[str, list[dict]]:
        self.held += text
        return "", []

    def _finish(self) -> tuple[str, list[dict]]:
        held, self.held = self.held, ""
        try:
            value = json.loads(held)
        except ValueError:
            return held, []
        if self.NAME is not None:
            return (
                ("", [tool_call(self.NAME, json.dumps(value, ensure_ascii=False))])
                if isinstance(value, dict)
                else (held, [])
            )
        calls = [_call(item) for item in value] if isinstance(value, list) else []
        return ("", calls) if calls and all(calls) else (held, [])


def forced_calls(tools: list[dict], choice) -> tuple[type[ToolParser], dict]:
    """For ``tool_choice`` ``required`` or ``{"type": "function", "function": {"name": ...}}``: the parser of the
    reply and the structured outputs that force it (vLLM's forms); ValueError naming an unknown function."""
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if choice == "required":
        one_call = [
            {
                "type": "object",
                "properties": {"name": {"enum": [name]}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in schemas.items()
        ]
        return ForcedCallsParser, {"json": {"type": "array", "minItems": 1, "items": {"anyOf": one_call}}}
    name = choice["function"]["name"]
    if name not in schemas:
        raise ValueError(f"tool_choice names function {name!r}, which is not among the tools")
    return type("NamedCallParser", (ForcedCallsParser,), {"NAME": name}), {"json": schemas[name]}


TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "mistral": MistralToolParser}
