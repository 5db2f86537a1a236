"""What the blocking and the asyncio client share (client/client.py, client/async_client.py): the request
messages they build from a caller's arguments (encoded only within the server's message limit), and the ZMQ DEALER
socket they open with its connection watch."""

from __future__ import annotations

import dataclasses
import itertools
import time
import uuid
from collections.abc import Sequence as _Seq

import zmq

from client.liveness import KEEPALIVE_S, ConnectionWatch, enable_heartbeats
from protocol.client_messages import (
    CLIENT_PROTOCOL_VERSION,
    DEFAULT_MAX_MESSAGE_BYTES,
    ChatPrompt,
    Detokenize,
    Generate,
    KeepAlive,
    Tokenize,
)
from protocol.codec import encode
from protocol.errors import MessageTooLargeError, RequestError
from protocol.sampling_params import SamplingParams
from settings.defaults import ZMQ_ADDRESS

DEFAULT_ADDRESS = ZMQ_ADDRESS
_CLOSE_LINGER_MS = 500  # time for queued aborts to reach the server when a client closes


def _prompt(prompt) -> str | list[int] | ChatPrompt:
    if isinstance(prompt, (str, ChatPrompt)):
        return prompt
    if isinstance(prompt, _Seq) or hasattr(prompt, "tolist"):  # list, tuple, numpy array
        ids = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
        # plain ints, checked at C speed (a per-id generator cost ~60 us a 1,024-id prompt); else id by id
        if set(map(type, ids)) <= {int} or all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            return ids
    raise RequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")


def _generate_msg(request_id: str, token: str | None, prompt, params: SamplingParams | None, stream: bool):
    p = params or SamplingParams()
    if not isinstance(p, SamplingParams):
        raise RequestError(f"params must be a SamplingParams, got {type(p).__name__}")
    return Generate(CLIENT_PROTOCOL_VERSION, request_id, token, _prompt(prompt), stream, p)


def chat_prompt(
    messages: list[dict],
    chat_template_kwargs: dict | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> ChatPrompt:
    """A conversation as a prompt: the server renders it with the model's chat template. ``continue_final_message``
    (vLLM's): the last message, an assistant's, is continued rather than closed; it needs add_generation_prompt
    off, and travels to the template as the template argument of that name."""
    if continue_final_message:
        if add_generation_prompt:
            raise RequestError("continue_final_message and add_generation_prompt cannot both be true")
        if chat_template_kwargs is None or isinstance(chat_template_kwargs, dict):  # else the server refuses it
            chat_template_kwargs = {**(chat_template_kwargs or {}), "continue_final_message": True}
    return ChatPrompt(list(messages), chat_template_kwargs, add_generation_prompt)


def _prompts_list(prompts) -> list:
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
        return [prompts]  # one prompt, as LLM.generate takes it
    return list(prompts)


def _params_list(prompts: list, params) -> list:
    if params is None or isinstance(params, SamplingParams):
        return [params] * len(prompts)
    params = list(params)
    if len(params) != len(prompts):
        raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
    return params


def _too_large(msg, size: int, limit: int) -> MessageTooLargeError:
    """The refusal of a message over the server's limit, naming what made it large (the message's first word)."""
    if isinstance(msg, Detokenize):
        field = "token_ids"
    elif isinstance(msg, Generate) and 2 * len(encode(msg.params)) > size:  # e.g. megabytes of stop strings
        field = "params"
    else:
        field = "prompt"
    return MessageTooLargeError(
        f"{field}: the request is {size} bytes encoded, over the server's limit of {limit} bytes per message "
        "(--max-message-bytes); it was not sent",
        size,
        limit,
    )


def _as_dict(reply) -> dict:
    d = dataclasses.asdict(reply)
    d.pop("request_id", None)
    return d


class _Base:
    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        token: str | None,
        timeout: float | None,
        connect_timeout: float | None,
        max_message_bytes: int | None = None,
    ) -> None:
        self.token = token
        # the server's --max-message-bytes (its default until info() learns it): ZMQ would drop a larger message
        # and disconnect this socket, so such a request is refused before it is sent
        self.max_message_bytes = max_message_bytes or DEFAULT_MAX_MESSAGE_BYTES
        self._prefix = uuid.uuid4().hex[:8]
        self._counter = itertools.count()
        self.address, self.timeout = address, timeout
        self._ctx = ctx
        self._sock, self._watch = self._socket(ctx, address, connect_timeout)
        self._last_sent = 0.0  # time.monotonic() of the last frame sent: any frame keeps the requests alive

    def _encode(self, msg) -> bytes:
        """The message's frame; MessageTooLargeError (a RequestError) when the server would refuse its size."""
        data = encode(msg)
        if len(data) > self.max_message_bytes:
            raise _too_large(msg, len(data), self.max_message_bytes)
        return data

    def _learn(self, info: dict) -> dict:
        """Take the server's message limit from its Info."""
        if info.get("max_message_bytes"):
            self.max_message_bytes = info["max_message_bytes"]
        return info

    def _new_id(self) -> str:
        return f"{self._prefix}-{next(self._counter)}"

    def _control(self, cls, rid: str):
        return cls(CLIENT_PROTOCOL_VERSION, rid, self.token)

    def _keepalive_frame(self) -> bytes | None:
        """A KeepAlive to send now (a second since the last frame sent), or None."""
        if time.monotonic() - self._last_sent < KEEPALIVE_S:
            return None
        return encode(KeepAlive(CLIENT_PROTOCOL_VERSION, "keepalive", self.token))

    def _generate_request(self, prompt, params: SamplingParams | None, stream: bool) -> Generate:
        return _generate_msg(self._new_id(), self.token, prompt, params, stream)

    def _labelled_request(self, prompt, params: SamplingParams | None, stream: bool, client: str) -> Generate:
        """``_generate_request``'s message for ``client`` (a label within this connection; "" leaves it as built)."""
        if not isinstance(client, str):
            raise RequestError(f"client must be a string, got {type(client).__name__}")
        msg = self._generate_request(prompt, params, stream)
        if client:
            msg.client = client
        return msg

    def _generate_requests(self, prompts, params, client: str = "") -> list[Generate]:
        """Not streamed, in LLM.generate's shapes: one prompt or a list; one SamplingParams (or None) or one each."""
        prompts = _prompts_list(prompts)
        return [self._labelled_request(p, sp, False, client) for p, sp in zip(prompts, _params_list(prompts, params))]

    def _tokenize_request(self, prompt, add_special_tokens: bool, return_token_strs: bool = False) -> Tokenize:
        if not isinstance(prompt, str):  # a conversation (list of messages)
            prompt = prompt if isinstance(prompt, ChatPrompt) else chat_prompt(prompt)
        return Tokenize(
            CLIENT_PROTOCOL_VERSION, self._new_id(), self.token, prompt, add_special_tokens, return_token_strs
        )

    def _detokenize_request(self, ids, per_token: bool, skip_special_tokens: bool) -> Detokenize:
        return Detokenize(
            CLIENT_PROTOCOL_VERSION, self._new_id(), self.token, list(ids), per_token, skip_special_tokens
        )

    @staticmethod
    def _socket(ctx, address: str, connect_timeout: float | None) -> tuple[zmq.Socket, ConnectionWatch]:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, _CLOSE_LINGER_MS)
        sock.setsockopt(zmq.RCVHWM, 0)  # never drop the server's replies on our side
        sock.setsockopt(zmq.SNDHWM, 0)
        enable_heartbeats(sock)
        if address.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        watch = ConnectionWatch(sock, address, connect_timeout)  # before connecting: the handshake is an event
        sock.connect(address)
        return sock, watch
