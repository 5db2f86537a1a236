"""What a finished request returns to its caller."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop", "length", "abort", "error"
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    logprobs: list[dict[int, float]] | None = None
    error: str | None = None
    metrics: dict = field(default_factory=dict)
