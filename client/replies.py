"""What comes back from a server, for both clients: error replies as exceptions, a request's deltas summed into a
``Completion``, and the state a sync or async stream keeps."""

from __future__ import annotations

import logging

from protocol.client_messages import ABORTED, ENGINE_DEAD, OVERLOADED, PROTOCOL, REQUEST_ERROR, Delta, Error
from protocol.codec import ProtocolError, decode
from protocol.errors import AbortedError, EngineDeadError, OverloadedError, RequestError
from protocol.outputs import Completion, PromptLogprobs

log = logging.getLogger("nanoserve.client")

_EXCEPTIONS = {
    REQUEST_ERROR: RequestError,
    ENGINE_DEAD: EngineDeadError,
    OVERLOADED: OverloadedError,
    PROTOCOL: ProtocolError,
    ABORTED: AbortedError,
}


def raise_error(err: Error):
    raise _EXCEPTIONS.get(err.kind, RuntimeError)(err.message)


def decode_reply(data: bytes) -> tuple[object, str | None]:
    """A reply and the request id it answers; a malformed reply is logged and answers no request (None)."""
    try:
        msg = decode(data)
    except ProtocolError as e:
        log.warning("dropping a malformed reply: %s", e)
        return None, None
    return msg, getattr(msg, "request_id", None)


class Accumulator:
    """Builds a Completion from a request's deltas."""

    __slots__ = ("request_id", "token_ids", "text", "logprobs", "prompt_logprobs")

    def __init__(self, request_id: str) -> None:
        self.request_id, self.token_ids, self.text = request_id, [], []
        self.logprobs: list[dict[int, float]] | None = None  # stays None unless the request asked for logprobs
        self.prompt_logprobs: PromptLogprobs | None = None  # likewise for prompt_logprobs

    def add(self, d: Delta) -> Completion | None:
        self.token_ids.extend(d.token_ids)
        self.text.append(d.text)
        if d.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(t.as_dict() for t in d.logprobs)
        if d.prompt_logprobs is not None:  # vLLM's None for the first prompt token, which nothing predicts
            self.prompt_logprobs = [None, *(p.as_dict() for p in d.prompt_logprobs)]
        if d.finish_reason is None:
            return None
        return Completion(
            request_id=self.request_id,
            prompt_token_ids=list(d.prompt_token_ids or []),
            token_ids=self.token_ids,
            text="".join(self.text),
            finish_reason=d.finish_reason,
            stop_reason=d.stop_reason,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
        )


class StreamState:
    """What a sync and an async stream share: accumulating deltas, retiring the request's reply queue
    (``replies``: the client's table of them) once done, aborting it when left early."""

    def __init__(self, client, request_id: str, replies: dict) -> None:  # client: the Client or AsyncClient
        self.client, self.request_id, self._replies = client, request_id, replies
        self.completion: Completion | None = None
        self._acc = Accumulator(request_id)
        self._done = False

    def _take(self, msg: Delta | Error) -> Delta:
        if isinstance(msg, Error):
            self._done = True
            self._replies.pop(self.request_id, None)
            raise_error(msg)
        self.completion = self._acc.add(msg)
        if self.completion is not None:
            self._done = True
            self._replies.pop(self.request_id, None)
        return msg

    def _close(self) -> None:
        if not self._done:
            self._done = True
            self.client._abort_quietly(self.request_id)

    def __del__(self) -> None:
        try:
            self._close()
        except Exception:
            pass
