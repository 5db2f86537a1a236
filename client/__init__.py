"""The remote clients, run in the user's process: ``Client``/``AsyncClient`` talk to a coordinator over ZMQ and
never load torch. The engine in your own process is ``nanoserve.LLM``; the HTTP front-end is openai_server/."""

from protocol.errors import AbortedError, EngineDeadError, MessageTooLargeError, OverloadedError, RequestError
from protocol.outputs import Completion, CompletionOutput, RequestOutput
from protocol.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "Client",
    "AsyncClient",
    "SamplingParams",
    "StructuredOutputsParams",
    "Completion",
    "RequestOutput",
    "CompletionOutput",
    "RequestError",
    "MessageTooLargeError",
    "EngineDeadError",
    "OverloadedError",
    "AbortedError",
]


def __getattr__(name):
    if name == "Client":  # zmq only; loaded on first use
        from client.client import Client

        return Client
    if name == "AsyncClient":
        from client.async_client import AsyncClient

        return AsyncClient
    raise AttributeError(name)
