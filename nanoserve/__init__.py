"""nanoserve's in-process API: ``from nanoserve import LLM, SamplingParams`` runs the coordinator in your process
(as vLLM's ``LLM`` does) and drives worker processes over the same ZMQ protocol as ``launch.py``. The records and
errors are the remote clients' own (client/, which never loads torch), exported here under the same names."""

import client

__all__ = ["LLM", *client.__all__]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; `nanoserve chat` and friends should start without them
    if name == "LLM":
        from nanoserve.llm import LLM

        return LLM
    if name in client.__all__:
        return getattr(client, name)
    raise AttributeError(name)
