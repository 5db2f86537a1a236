"""SamplingParams (vLLM's names and defaults), validated at construction: an error names the field.

The one shape of a request's sampling settings: it travels as a record (tag 10) inside ``Generate`` (client to
server) and ``StepCommand.new_params`` (coordinator to workers), and decoding it runs the same validation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.codec import record


@record(10)
@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1  # completions of the same prompt; they share its KV blocks
    skip_special_tokens: bool = True  # leave special tokens out of the text
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        def need(cond: bool, name: str, what: str) -> None:
            if not cond:
                raise ValueError(f"{name} {what}, got {getattr(self, name)!r}")

        def is_num(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        need(is_num(self.temperature) and 0 <= self.temperature <= 100, "temperature", "must be in [0, 100]")
        need(is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(is_int(self.top_k) and self.top_k >= -1, "top_k", "must be an int >= -1 (0 or -1 disables)")
        need(is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        need(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "must be an int >= 1")
        need(
            is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            "must be in [0, max_tokens]",
        )
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        need(all(is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be token ids >= 0")
        need(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a bool")
        need(
            self.seed is None or (is_int(self.seed) and 0 <= self.seed < 2**63),
            "seed",
            "must be None or an int in [0, 2**63)",
        )
        need(
            self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= 20),
            "logprobs",
            "must be in [0, 20]",
        )
        need(
            is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"
        )
        need(
            is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            "must be in [-2, 2]",
        )
        need(is_int(self.n) and 1 <= self.n <= 128, "n", "must be an int in [1, 128]")
        need(isinstance(self.skip_special_tokens, bool), "skip_special_tokens", "must be a bool")
        need(isinstance(self.include_stop_str_in_output, bool), "include_stop_str_in_output", "must be a bool")
        need(
            is_num(self.repetition_penalty) and 0 < self.repetition_penalty <= 10,
            "repetition_penalty",
            "must be in (0, 10]",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
