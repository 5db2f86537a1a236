"""Refusing text that is not Unicode: JSON may spell a lone UTF-16 surrogate ("\\ud800"), which Python keeps in a
str but no UTF-8 encoder (msgpack's, the tokenizer's) takes, so a request holding one is a 400 naming the field
before anything tries to send it."""

from __future__ import annotations

import re

from pydantic import BaseModel
from starlette.requests import Request

from openai_server.errors import APIError


def _is_unicode(text: str) -> bool:
    if text.isascii():  # the common case, at C speed
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_SCALARS = frozenset((int, float, bool, type(None)))


def _first_bad(value: object) -> str | None:
    """Where the first non-Unicode string in ``value`` sits (e.g. "[0].content"), or None; iterative, since a
    body may nest as deep as the JSON parser allows."""
    stack: list[tuple[object, str]] = [(value, "")]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if not _is_unicode(item):
                return where
        elif isinstance(item, (BaseModel, dict)):
            pairs = list(item) if isinstance(item, BaseModel) else list(item.items())
            for k, v in reversed(pairs):
                if isinstance(k, str) and not _is_unicode(k):
                    return where
                stack.append((v, f"{where}.{k}"))
        elif isinstance(item, (list, tuple)) and not set(map(type, item)) <= _SCALARS:  # token ids: skipped at once
            stack.extend((v, f"{where}[{i}]") for i, v in reversed(list(enumerate(item))))
    return None


# a lone surrogate reaches a str only as a JSON escape (UTF-8 bytes cannot hold one): no such escape, no walk
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


async def check_request_text(request: Request, req: BaseModel) -> None:
    """check_text, only for a body that spells a surrogate at all: the walk costs seconds on a body of a hundred
    thousand chat messages, the search milliseconds (FastAPI cached the body it parsed)."""
    if _SURROGATE_ESCAPE.search(await request.body()):
        check_text(req)


def check_text(req: BaseModel) -> None:
    """A 400 naming the field (``param``: the top-level one) when any string in the request, a key included,
    holds a lone surrogate (pydantic itself refuses one in a field's name)."""
    for name, value in req:  # declared fields, then the extra ones a request may carry
        where = _first_bad(value)
        if where is not None:
            raise APIError(400, f"{name}{where}: not valid Unicode text (a lone UTF-16 surrogate)", name)
