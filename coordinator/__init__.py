"""The coordinator process (``launch.py``, or the caller's process under ``nanoserve.LLM``): tokenizer, scheduler,
KV block manager, the client endpoint and the worker group it drives over ZMQ."""
