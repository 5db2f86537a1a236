"""What the engine hands back: a ``RequestOutput`` per request and step, and the ``Completion`` a caller keeps."""

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


@dataclass(slots=True)
class RequestOutput:
    """One request's news from one engine step. A streamed request gets one per step it gained tokens in, with
    the new tokens and the new text that is safe to show (text that may still become a stop string is held
    back); any other request gets a single one when it finishes, with everything. The last one has
    ``finish_reason`` and ``prompt_token_ids``."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None = None  # one per token in token_ids, when the request asked
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    prompt_token_ids: list[int] | None = None  # on the last output only

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def completion(self) -> Completion:
        """The Completion of a request that was not streamed, from its only output."""
        return Completion(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids or [],
            token_ids=self.token_ids,
            text=self.text,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=self.logprobs,
        )
