"""A stream's common event (openai_server/streaming.TextEvents: one choice's new text, from parts built once per
request) is byte for byte the event ``sse`` makes of the response's dict, for any text and any model name."""

from __future__ import annotations

import json

import pytest

from openai_server.streaming import TextEvents, sse

TEXTS = ["", " hello", 'quote " and \\ backslash', "line\nbreak\ttab\x00\x1f", "é漢字😀", "\x85\u2028\u2029 splitters"]
MODELS = ["Qwen/Qwen3-8B", "modèle\u2028x"]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("chat", [False, True])
def test_a_text_event_is_the_dicts_event(model, chat):
    head = {"id": "cmpl-0123", "object": "chat.completion.chunk" if chat else "text_completion", "created": 17,
            "model": model}  # fmt: skip
    events = TextEvents(head, chat)
    for index in (0, 7, 130):
        for text in TEXTS:
            body = {"delta": {"content": text}} if chat else {"text": text}
            choice = {"index": index, **body, "logprobs": None, "finish_reason": None}
            expected = sse({**head, "choices": [choice]})
            assert events.event(index, text) == expected
            line = expected.decode()[6:-2]
            assert "\n" not in line and "\u2028" not in line and json.loads(line)["choices"][0]["index"] == index
