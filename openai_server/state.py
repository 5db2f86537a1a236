"""What every route shares: the coordinator client, the metrics, the key and the output parsers."""

from __future__ import annotations

from dataclasses import dataclass

from openai_server.engine_client import EngineClient
from openai_server.metrics import Metrics


@dataclass(slots=True)
class ServerState:
    engine: EngineClient
    metrics: Metrics
    api_key: str | None = None
    reasoning_parser: type | None = None  # e.g. Qwen3ReasoningParser: chat replies get reasoning_content
    tool_parser: type | None = None  # e.g. HermesToolParser (--enable-auto-tool-choice): chat replies get tool_calls
