"""nanoserve's in-process API: ``from nanoserve import LLM, SamplingParams`` runs the coordinator in your process
(as vLLM's ``LLM`` does) and drives worker processes over the same ZMQ protocol as ``launch.py``. The remote clients
(``Client``, ``AsyncClient``) live in client/, which never loads torch."""

from protocol.errors import AbortedError, EngineDeadError, MessageTooLargeError, OverloadedError, RequestError
from protocol.outputs import Completion, CompletionOutput, RequestOutput
from protocol.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
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


def __getattr__(name: str):
    # LLM pulls in torch and transformers; `nanoserve chat` and friends should start without them
    if name == "LLM":
        from nanoserve.llm import LLM

        return LLM
    raise AttributeError(name)
