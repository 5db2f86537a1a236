"""A request's scheduling state, in one place: its tokens, how many are in the KV cache, its blocks and its slot,
and the one token-level stop check (``token_stop``). Its output text, and stop strings, are the output
processor's (coordinator/output_processor.py)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from protocol.sampling_params import SamplingParams

# (finish_reason, stop_reason) of a token-level stop
TokenStop = tuple[str, int | None]
EOS: TokenStop = ("stop", None)
LENGTH: TokenStop = ("length", None)


class SeqStatus(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    arrival: float
    status: SeqStatus = SeqStatus.WAITING
    num_pending: int = 0  # trailing placeholder tokens (-1) sampled in steps still in flight
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache (or being computed this step)
    num_cached_tokens: int = 0  # prefix-cache hits on the last admission
    block_table: list[int] = field(default_factory=list)
    num_blocks_sent: int = 0  # blocks the workers already know about
    num_keyed_blocks: int = 0  # full blocks registered in the prefix cache
    last_block_key: int = -1
    slot: int = -1  # worker state slot while running
    new_in_slot: bool = False  # workers must (re)start this sequence in its slot
    finish_reason: str | None = None
    every_token: bool = False  # the output processor takes each new token (streaming, stop strings, logprobs)
    prompt_logprobs_upto: int = 0  # prompt_logprobs: last prompt position whose logprobs a scheduled step computes
    grammar: object | None = None  # structured outputs: its matcher (coordinator/structured_outputs.py)
    # speculative decoding (coordinator/spec_schedule.py): drafts of its verify row in flight (0: none; it is not
    # rescheduled until that result is applied), the step from which a proposal is tried again, the current back-off
    verify_drafts: int = 0
    spec_next_try: int = 0
    spec_backoff: int = 0
    spec_held: bool = False  # held back this step so that a proposal can follow its in-flight tokens
    spec_tokens: object | None = None  # the n-gram proposer's int32 mirror of its known tokens (coordinator/ngram.py)
    spec_synced: int = 0  # tokens copied into it
    spec_ok: bool | None = None  # its params allow drafts (no penalties, no structured outputs); None: not asked yet
    # prompt + max_tokens: the length stop. Admission resolved max_tokens and checked this against max_model_len
    max_num_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.max_num_tokens = self.num_prompt_tokens + (self.params.max_tokens or 1 << 62)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens, counting those still in flight."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are known (placeholders of in-flight steps excluded)."""
        return len(self.token_ids) - self.num_pending

    @property
    def output_token_ids(self) -> list[int]:
        """Output tokens known so far."""
        return self.token_ids[self.num_prompt_tokens : self.num_known_tokens]

    def resolve_pending(self, token: int) -> None:
        """The oldest in-flight step's token arrived: it replaces the first placeholder."""
        self.token_ids[self.num_known_tokens] = token
        self.num_pending -= 1

    def drop_pending(self) -> None:
        if self.num_pending:
            del self.token_ids[-self.num_pending :]
            self.num_pending = 0

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def all_sampled(self) -> bool:
        """Its last output token is sampled (maybe still in flight): the length stop, seen by the scheduler ahead."""
        return len(self.token_ids) >= self.max_num_tokens

    def token_stop(self, token: int, eos_token_ids: set[int]) -> TokenStop | None:
        """The token-level stop once ``token``, its newest known token, is applied: a stop id or EOS (not before
        min_tokens outputs), else the length (max_tokens). The engine calls it once per applied token."""
        p = self.params
        num_known = len(self.token_ids) - self.num_pending
        if num_known - self.num_prompt_tokens >= p.min_tokens:
            if token in p.stop_token_ids:
                return ("stop", token)
            if not p.ignore_eos and token in eos_token_ids:
                return EOS
        return LENGTH if num_known >= self.max_num_tokens else None
