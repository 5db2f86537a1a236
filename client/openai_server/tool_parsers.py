"""Tool-call parsers: find the calls a model writes into its output text and return them as OpenAI ``tool_calls``,
as the output streams. ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, the format
of Hermes, Qwen2.5 and Qwen3 chat templates (vLLM's ``--tool-call-parser hermes``)."""

from __future__ import annotations

import json
import uuid

from client.openai_server.reasoning import partial_tag_suffix


def tool_call(name: str, arguments: str) -> dict:
    """An OpenAI tool call with a fresh id; ``arguments`` is the JSON text of the arguments object."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


class HermesToolParser:
    """Text outside ``<tool_call>`` blocks is content; each block's JSON becomes a call. A block still open when
    the output ends (max_tokens, or the end-of-turn token right after its JSON) is a call if its JSON parses, and
    content otherwise, as is a block whose JSON is not a call. Text that may be the start of a tag is held back
    until it is not."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.held = ""  # content that may begin a tag, or the open block's text
        self.in_call = False
        self.calls = 0  # calls returned so far: the next one's index in a stream

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """The content and the calls completed by the next piece of output."""
        content, calls = self._feed(text)
        self.calls += len(calls)
        return content, calls

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

    def finish(self) -> tuple[str, list[dict]]:
        """What was held back, once the output is complete."""
        held, self.held = self.held, ""
        if not self.in_call:
            return held, []
        self.in_call, call = False, _parse(held)
        if call is None:
            return self.START + held, []
        self.calls += 1
        return "", [call]

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


def _parse(block: str) -> dict | None:
    """The call a block's JSON names ({"name": str, "arguments": object or JSON text}), or None."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return tool_call(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


TOOL_PARSERS = {"hermes": HermesToolParser}
