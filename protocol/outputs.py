"""What the engine hands back: a ``StepOutput`` per request and step, and the ``Completion`` a caller keeps; what
``LLM.generate`` returns: vLLM-shaped ``RequestOutput``s of ``CompletionOutput``s."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One token's entry in a prompt position's logprobs (vLLM's ``Logprob``): its log-probability, its rank in
    that position's distribution (1 = most likely) and its own text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's shape of RequestOutput.prompt_logprobs: None for the first prompt token (nothing predicts it), then per
# prompt token {token id: Logprob}, the prompt token first, then the top N
PromptLogprobs = list[dict[int, Logprob] | None]
# vLLM's shape of CompletionOutput.logprobs: per sampled token {token id: Logprob}, the sampled token first
SampleLogprobs = list[dict[int, Logprob]]


def sample_logprobs(raw: list[dict[int, float]], top_n: int, token_text) -> SampleLogprobs:
    """The wire's logprobs of a sample (per token: the sampled token's, then the top ``top_n``'s) as vLLM's
    ``Logprob``s. Ranks count the larger entries, which holds for the top N; a sampled token outside them (the
    entry has top_n + 1 tokens) has a rank the wire does not carry: None. ``token_text``: id -> its text."""
    out = []
    for d in raw:
        values = list(d.values())
        outside = len(d) > top_n
        entry = {}
        for i, (t, v) in enumerate(d.items()):
            rank = None if i == 0 and outside else 1 + sum(w > v for w in values)
            entry[t] = Logprob(v, rank, token_text(t))
        out.append(entry)
    return out


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
    prompt_logprobs: PromptLogprobs | None = None  # when the request asked (prompt_logprobs=N)


@dataclass(slots=True)
class StepOutput:
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
    prompt_logprobs: PromptLogprobs | None = None  # on the last output only, when the request asked
    num_prompt_tokens: int = 0  # on every output: a stream read only in part still says what its prompt cost

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
            prompt_logprobs=self.prompt_logprobs,
        )


@dataclass(slots=True)
class CompletionOutput:
    """One sampled continuation of a prompt (vLLM's shape)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of the sampled tokens' logprobs, when logprobs were asked for
    logprobs: SampleLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None

    @classmethod
    def from_completion(cls, index: int, c: Completion, top_n: int | None, token_text) -> CompletionOutput:
        """``c`` as the ``index``-th sample; ``top_n``: the request's ``logprobs``, ``token_text``: id -> text."""
        cumulative, logprobs = None, None
        if c.logprobs is not None:  # each dict holds the sampled token first
            cumulative = sum(next(iter(d.values())) for d in c.logprobs if d)
            logprobs = sample_logprobs(c.logprobs, top_n or 0, token_text)
        return cls(index, c.text, c.token_ids, cumulative, logprobs, c.finish_reason, c.stop_reason)


@dataclass(slots=True)
class RequestOutput:
    """What ``LLM.generate``/``LLM.chat`` return per prompt (vLLM's shape): its ``outputs`` are the n samples.
    ``text``, ``token_ids``, ``finish_reason``, ``stop_reason`` and ``logprobs`` are the first sample's, as
    ``Completion`` has them."""

    request_id: str
    prompt: str | None  # the prompt text (None for a token-id prompt)
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: dict = field(default_factory=dict)
    prompt_logprobs: PromptLogprobs | None = None  # when the request asked (prompt_logprobs=N)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.outputs[0].stop_reason

    @property
    def logprobs(self) -> SampleLogprobs | None:
        return self.outputs[0].logprobs
