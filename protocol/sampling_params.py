"""SamplingParams (vLLM's names and defaults), validated where input enters: an error names the field.

The one shape of a request's sampling settings: it travels as a sparse record (tag 10: only its non-default
fields, by name) inside ``Generate`` (client to server) and ``StepCommand.new_params`` (coordinator to workers).
``validate`` is its one semantic check. It runs at construction and where the coordinator reads a client's
Generate (coordinator/client_frames.py); decoding checks the wire types only, so a worker never re-validates.
Checks that need the model (token ids against the vocabulary) are ``check_token_ids``, run by admission.

A new sampling field is a field here (its check in ``validate``; ``metadata={"token_ids": True}`` when it holds
token ids), the HTTP schema's field of the same name (openai_server/schemas.py) if it is HTTP-visible, and the
code that applies it (a worker/logits_processors.py processor, for a field the sampler applies).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace

from protocol.records import record

_NUMBER = (int, float)
_F32_MAX = 3.4028234663852886e38  # a bias is added to float32 logits: it must stay finite there
MAX_LOGPROBS = 20  # logprobs and prompt_logprobs: top alternatives per token, as vLLM's default max_logprobs
I64_END = 2**63  # every int field travels as a signed 64-bit int at most (msgpack packs nothing >= 2**64 at all)


def _is_num(v) -> bool:  # NaN fails every range check below
    return isinstance(v, _NUMBER) and not isinstance(v, bool)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_logit_bias(bias) -> None:
    """ValueError naming logit_bias (and the bad entry, not the whole dict) unless it maps ints >= 0 to finite
    float32 numbers."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}")
    for k, v in bias.items():
        if not (_is_int(k) and 0 <= k < I64_END):
            raise ValueError(f"logit_bias keys must be token ids (ints >= 0, < 2^63), got {k!r}")
        if not (_is_num(v) and math.isfinite(v) and abs(v) <= _F32_MAX):
            raise ValueError(f"logit_bias values must be finite numbers, got {v!r} for token {k}")


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")  # vLLM's StructuredOutputsParams fields


class StructuredOutputsParams:
    """vLLM's spelling of a constraint, for ``SamplingParams(structured_outputs=StructuredOutputsParams(json=...))``:
    give exactly one field (a plain dict of one of them is taken too). Not a record: SamplingParams turns it into
    its canonical text at construction, so it never travels."""

    __slots__ = STRUCTURED_KINDS

    def __init__(
        self,
        json: dict | str | None = None,
        regex: str | None = None,
        choice: list[str] | None = None,
        grammar: str | None = None,
        json_object: bool | None = None,
    ) -> None:
        self.json, self.regex, self.choice, self.grammar, self.json_object = json, regex, choice, grammar, json_object


def structured_spec(spec) -> str:
    """vLLM's ``structured_outputs`` (one of STRUCTURED_KINDS: a JSON schema as a dict or text, a regex, a list of
    choices, an EBNF grammar, or ``json_object: True`` for any JSON object; a dict or a StructuredOutputsParams) as
    the canonical JSON text the record carries; ValueError naming the field unless it is exactly one well-typed
    kind."""
    if isinstance(spec, StructuredOutputsParams):
        spec = {k: getattr(spec, k) for k in STRUCTURED_KINDS}
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError:
            raise ValueError(f"structured_outputs must be a dict or its JSON text, got {spec[:80]!r}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"structured_outputs must be a dict, got {type(spec).__name__}")
    given = {k: v for k, v in spec.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(STRUCTURED_KINDS))
    if unknown or len(given) != 1:
        what = f"unknown fields {unknown}" if unknown else f"{len(given)} given"
        raise ValueError(f"structured_outputs must give exactly one of {', '.join(STRUCTURED_KINDS)} ({what})")
    (kind, value), ok = next(iter(given.items())), True
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                ok = False
        ok = ok and isinstance(value, (dict, bool))
    elif kind == "choice":
        ok = isinstance(value, list) and bool(value) and all(isinstance(c, str) and c for c in value)
    elif kind == "json_object":
        ok = value is True
    else:
        ok = isinstance(value, str) and bool(value)
    if not ok:
        raise ValueError(f"structured_outputs.{kind} is not a valid {kind}: {str(value)[:80]!r}")
    return json.dumps({kind: value}, sort_keys=True)


@record(10, sparse=True)
@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int | None = 16  # None: up to max_model_len (the engine sets it once the prompt is tokenized)
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)  # a str is taken as [str]
    stop_token_ids: list[int] = field(default_factory=list, metadata={"token_ids": True})
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1  # completions of the same prompt; they share its KV blocks
    skip_special_tokens: bool = True  # leave special tokens out of the text
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text
    # token id -> added to that token's logit before min_tokens masks, penalties, temperature and filters (vLLM's
    # order); ids are checked against the vocabulary by the engine. Travels as a flat [id, bias, ...] list.
    logit_bias: dict[int, float] | None = field(default=None, metadata={"token_ids": True})
    prompt_logprobs: int | None = None  # top-N logprobs of every prompt token (after the first), as vLLM
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens (-1: max_model_len)
    # vLLM's structured outputs: the coordinator masks every sampled token to what keeps the output valid. Given
    # as a dict (STRUCTURED_KINDS), carried as its canonical JSON text (structured_spec).
    structured_outputs: str | None = None
    # vLLM's: sample only among these token ids (EOS too only if listed); checked against the vocabulary at admission
    allowed_token_ids: list[int] | None = field(default=None, metadata={"token_ids": True})

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Takes vLLM's other spellings into the canonical ones, then raises ValueError naming the first bad field.
        The one semantic check of a request's settings: at construction and where a client's record enters the
        coordinator (the dataclass is mutable, and a raw ZMQ client is untrusted). One inline check per field."""
        # vLLM's spellings: a lone str, a tuple, None; any other type is left for the checks below to name
        if self.stop is None or isinstance(self.stop, (str, tuple)):
            self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        if self.stop_token_ids is None or isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids or ())
        if isinstance(self.logit_bias, dict) and not self.logit_bias:
            self.logit_bias = None  # one way to say "no bias": the worker's fast path tests for None
        if self.structured_outputs is not None:  # its canonical text (idempotent); raises naming the field
            self.structured_outputs = structured_spec(self.structured_outputs)
        if not (_is_num(self.temperature) and 0 <= self.temperature <= 100):
            self._bad("temperature", "must be in [0, 100]")
        if not (_is_num(self.top_p) and 0 < self.top_p <= 1):
            self._bad("top_p", "must be in (0, 1]")
        if not (_is_int(self.top_k) and -1 <= self.top_k < I64_END):
            self._bad("top_k", "must be an int >= -1 (0 or -1 disables; < 2^63)")
        if not (_is_num(self.min_p) and 0 <= self.min_p <= 1):
            self._bad("min_p", "must be in [0, 1]")
        if not (self.max_tokens is None or (_is_int(self.max_tokens) and 1 <= self.max_tokens < I64_END)):
            self._bad("max_tokens", "must be None (up to max_model_len) or an int >= 1 (and < 2^63)")
        if not (_is_int(self.min_tokens) and 0 <= self.min_tokens <= (self.max_tokens or I64_END - 1)):
            self._bad("min_tokens", "must be in [0, max_tokens]")
        if type(self.stop) is not list or not all(isinstance(s, str) and s for s in self.stop):
            self._bad("stop", "must be a non-empty string or a list of them")
        if type(self.stop_token_ids) is not list or not all(
            _is_int(t) and 0 <= t < I64_END for t in self.stop_token_ids
        ):
            self._bad("stop_token_ids", "must be a list of token ids (ints >= 0, < 2^63)")
        if not isinstance(self.ignore_eos, bool):
            self._bad("ignore_eos", "must be a bool")
        if not (self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**63)):
            self._bad("seed", "must be None or a 64-bit int")
        if not (self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS)):
            self._bad("logprobs", "must be in [0, 20]")
        if not (_is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2):
            self._bad("presence_penalty", "must be in [-2, 2]")
        if not (_is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2):
            self._bad("frequency_penalty", "must be in [-2, 2]")
        if not (_is_int(self.n) and 1 <= self.n <= 128):
            self._bad("n", "must be an int in [1, 128]")
        if not isinstance(self.skip_special_tokens, bool):
            self._bad("skip_special_tokens", "must be a bool")
        if not isinstance(self.include_stop_str_in_output, bool):
            self._bad("include_stop_str_in_output", "must be a bool")
        if not (_is_num(self.repetition_penalty) and 0 < self.repetition_penalty <= 10):
            self._bad("repetition_penalty", "must be in (0, 10]")
        if self.logit_bias is not None:  # a call (a loop over the entries) only for a request that has some
            _check_logit_bias(self.logit_bias)
        n = self.prompt_logprobs
        if not (n is None or (_is_int(n) and 0 <= n <= MAX_LOGPROBS)):
            self._bad("prompt_logprobs", f"must be None or an int in [0, {MAX_LOGPROBS}]")
        k = self.truncate_prompt_tokens
        if not (k is None or (_is_int(k) and (1 <= k < I64_END or k == -1))):
            self._bad("truncate_prompt_tokens", "must be None, -1 (max_model_len) or an int >= 1 (and < 2^63)")
        ids = self.allowed_token_ids
        if not (ids is None or (type(ids) is list and ids and all(_is_int(t) and 0 <= t < I64_END for t in ids))):
            self._bad("allowed_token_ids", "must be None or a non-empty list of token ids (ints >= 0, < 2^63)")

    def check_token_ids(self, vocab_size: int) -> None:
        """ValueError naming the first field of token ids (``metadata={"token_ids": True}``: a list, or a dict's
        keys) with an id outside the model's vocabulary; ``validate`` has checked that they are ints >= 0."""
        for name in TOKEN_ID_FIELDS:
            ids = getattr(self, name)
            if ids and max(ids) >= vocab_size:
                raise ValueError(f"{name} token ids must be below the vocabulary size {vocab_size}, got {max(ids)}")

    def _bad(self, name: str, what: str) -> None:
        raise ValueError(f"{name} {what}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def choices(self) -> list[SamplingParams]:
        """The n samples of a request as n requests of n=1, which share the prompt's KV blocks through the prefix
        cache; a seeded request gives each its own seed (seed + index), so they differ and stay reproducible."""
        if self.n == 1:
            return [self]
        if self.seed is None:
            return [replace(self, n=1)] * self.n
        return [replace(self, n=1, seed=(self.seed + i) % 2**63) for i in range(self.n)]


TOKEN_ID_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.metadata.get("token_ids"))
