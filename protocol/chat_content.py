"""A chat message's content as chat templates take it: OpenAI's message content (a string, null, or a list of
parts) flattened to a string. The HTTP front-end, ``LLM.chat`` and the coordinator's chat rendering share it, so
every way in accepts the same messages."""

from __future__ import annotations

from protocol.errors import RequestError


def content_text(content: object, where: str) -> str | None:
    """``content`` as a string (None stays None): text parts ``[{"type": "text", "text": ...}]`` are joined with
    newlines, as vLLM joins them. Anything else raises RequestError naming ``where`` (e.g. "messages[0].content")."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string, a list of text parts or null, got {type(content).__name__}")
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise RequestError(f"{where}: only text parts are supported")
        parts.append(part["text"])
    return "\n".join(parts)
