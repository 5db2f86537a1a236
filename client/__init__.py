"""nanoserve's client side: the offline ``LLM`` API (vLLM-shaped ``RequestOutput``s), ``Client``/``AsyncClient``
over ZMQ, and the OpenAI-compatible HTTP front-end (client/openai_server/, its own process)."""

from protocol.errors import AbortedError, EngineDeadError, MessageTooLargeError, OverloadedError, RequestError
from protocol.outputs import Completion, CompletionOutput, RequestOutput
from protocol.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
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
    # LLM pulls in torch and transformers; a remote client should not have to
    if name == "LLM":
        from client.llm import LLM

        return LLM
    if name == "Client":  # zmq only; loaded on first use
        from client.client import Client

        return Client
    if name == "AsyncClient":
        from client.async_client import AsyncClient

        return AsyncClient
    raise AttributeError(name)
