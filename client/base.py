"""What the blocking and the asyncio client share (client/client.py, client/async_client.py): the request
messages they build from a caller's arguments, and the ZMQ DEALER socket they open with its connection watch."""

from __future__ import annotations

import dataclasses
import itertools
import uuid
from collections.abc import Sequence as _Seq

import zmq

from client.liveness import ConnectionWatch, enable_heartbeats
from protocol.client_messages import CLIENT_PROTOCOL_VERSION, ChatPrompt, Detokenize, Generate, Tokenize
from protocol.errors import RequestError
from protocol.sampling_params import SamplingParams

DEFAULT_ADDRESS = "tcp://127.0.0.1:8765"
_CLOSE_LINGER_MS = 500  # time for queued aborts to reach the server when a client closes


def _prompt(prompt) -> str | list[int] | ChatPrompt:
    if isinstance(prompt, (str, ChatPrompt)):
        return prompt
    if isinstance(prompt, _Seq) or hasattr(prompt, "tolist"):  # list, tuple, numpy array
        ids = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            return ids
    raise RequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")


def _generate_msg(request_id: str, token: str | None, prompt, params: SamplingParams | None, stream: bool):
    p = params or SamplingParams()
    if not isinstance(p, SamplingParams):
        raise RequestError(f"params must be a SamplingParams, got {type(p).__name__}")
    return Generate(CLIENT_PROTOCOL_VERSION, request_id, token, _prompt(prompt), stream, p)


def chat_prompt(messages: list[dict], chat_template_kwargs: dict | None = None) -> ChatPrompt:
    """A conversation as a prompt: the server renders it with the model's chat template."""
    return ChatPrompt(list(messages), chat_template_kwargs, True)


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


def _as_dict(reply) -> dict:
    d = dataclasses.asdict(reply)
    d.pop("request_id", None)
    return d


class _Base:
    def __init__(
        self, ctx: zmq.Context, address: str, token: str | None, timeout: float | None, connect_timeout: float | None
    ) -> None:
        self.token = token
        self._prefix = uuid.uuid4().hex[:8]
        self._counter = itertools.count()
        self.address, self.timeout = address, timeout
        self._ctx = ctx
        self._sock, self._watch = self._socket(ctx, address, connect_timeout)

    def _new_id(self) -> str:
        return f"{self._prefix}-{next(self._counter)}"

    def _control(self, cls, rid: str):
        return cls(CLIENT_PROTOCOL_VERSION, rid, self.token)

    def _generate_request(self, prompt, params: SamplingParams | None, stream: bool) -> Generate:
        return _generate_msg(self._new_id(), self.token, prompt, params, stream)

    def _generate_requests(self, prompts, params) -> list[Generate]:
        """Not streamed, in LLM.generate's shapes: one prompt or a list; one SamplingParams (or None) or one each."""
        prompts = _prompts_list(prompts)
        return [self._generate_request(p, sp, False) for p, sp in zip(prompts, _params_list(prompts, params))]

    def _tokenize_request(self, prompt, add_special_tokens: bool) -> Tokenize:
        if not isinstance(prompt, str):  # a conversation (list of messages)
            prompt = prompt if isinstance(prompt, ChatPrompt) else chat_prompt(prompt)
        return Tokenize(CLIENT_PROTOCOL_VERSION, self._new_id(), self.token, prompt, add_special_tokens)

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
