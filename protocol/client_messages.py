"""Messages between clients and the coordinator's client endpoint (tags 20+). Wire format: protocol/codec.py.

Every request carries ``protocol_version`` as its first field (so a mismatch is recognised even when the field
count differs), a client-chosen ``request_id`` (scoped to the client's connection; replies carry it back) and
``token`` (the server's shared secret, or None when it has none). Fields annotated ``object`` are untyped on the
wire (``prompt`` is a string, a list of token ids or a ChatPrompt record): the engine validates them.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.outputs import Logprob
from protocol.records import record
from protocol.sampling_params import SamplingParams
from settings.defaults import MAX_MESSAGE_BYTES

# 4: Tokenize/Detokenize, ChatPrompt prompts, InfoReply.generation_defaults; 5: logit_bias, prompt_logprobs;
# 6: InfoReply.max_message_bytes; 7: Tokenize.return_token_strs; 8: Delta.num_prompt_tokens;
# 9: SamplingParams.truncate_prompt_tokens; 10: SamplingParams.structured_outputs; 11: Generate.client, KeepAlive,
# InfoReply's per-client limits, StatsReply's per-client counters; 12: SamplingParams travels sparse (its non-default
# fields by name: a new field needs no new version)
CLIENT_PROTOCOL_VERSION = 12
DEFAULT_MAX_MESSAGE_BYTES = MAX_MESSAGE_BYTES  # the server's default --max-message-bytes (settings/defaults.py)

# Error.kind values
REQUEST_ERROR = "RequestError"  # a bad request; the message names the field
ENGINE_DEAD = "EngineDeadError"  # the workers (or the server) failed; the server exits
OVERLOADED = "Overloaded"  # too many requests pending; retry later
PROTOCOL = "Protocol"  # malformed frame, protocol version mismatch, bad token
# the server is shutting down: a request still running past the drain (--shutdown-timeout), or a new one
ABORTED = "Aborted"
ERROR_KINDS = (REQUEST_ERROR, ENGINE_DEAD, OVERLOADED, PROTOCOL, ABORTED)


# ---- client -> server ----------------------------------------------------------------------------------


@record(20)
@dataclass(slots=True)
class Generate:
    protocol_version: int
    request_id: str
    token: str | None
    prompt: object  # str | list[int]
    stream: bool  # True: a Delta per step; False: one Delta when finished
    params: SamplingParams  # decoding checks its wire types; the server validates it (a RequestError naming the field)
    # who the request is for, within this connection (e.g. the HTTP front-end's user): the server's per-client
    # pending limit counts requests per (connection, client)
    client: str = ""


@record(21)
@dataclass(slots=True)
class Abort:
    """Stop a request and free its KV blocks; it ends with a Delta whose finish_reason is "abort"."""

    protocol_version: int
    request_id: str
    token: str | None


@record(22)
@dataclass(slots=True)
class Health:
    protocol_version: int
    request_id: str
    token: str | None


@record(23)
@dataclass(slots=True)
class Info:
    protocol_version: int
    request_id: str
    token: str | None


@record(24)
@dataclass(slots=True)
class Stats:
    protocol_version: int
    request_id: str
    token: str | None


@record(25)
@dataclass(slots=True)
class KeepAlive:
    """A sign of life: sent about every second while a client has requests in flight, and never answered. The
    server aborts the requests of a connection that sends nothing for its --client-heartbeat-timeout (the client
    died or its host is gone), so they do not hold the queue and KV blocks. Any other request counts as well."""

    protocol_version: int
    request_id: str
    token: str | None


@record(26)
@dataclass(slots=True)
class Tokenize:
    """Token ids of a prompt (a string or a ChatPrompt), as the engine would see them; answered by TokenizeReply."""

    protocol_version: int
    request_id: str
    token: str | None
    prompt: object  # str | ChatPrompt
    add_special_tokens: bool
    return_token_strs: bool = False  # also each id's token string, as the vocabulary spells it


@record(27)
@dataclass(slots=True)
class Detokenize:
    """Text of token ids; with ``per_token`` also each id's own text (e.g. for logprobs). Answered by
    DetokenizeReply."""

    protocol_version: int
    request_id: str
    token: str | None
    token_ids: list[int]
    per_token: bool
    skip_special_tokens: bool


@record(45)
@dataclass(slots=True)
class ChatPrompt:
    """A conversation to continue, sent in place of a prompt (Generate.prompt, Tokenize.prompt): the coordinator
    renders it with the tokenizer's chat template. ``messages``: [{"role": str, "content": str, ...}];
    ``chat_template_kwargs``: extra template variables (e.g. Qwen3's ``enable_thinking``) or None."""

    messages: object  # list[dict]; checked by the engine
    chat_template_kwargs: object | None  # dict
    add_generation_prompt: bool = True


CLIENT_REQUESTS = (Generate, Abort, Health, Info, Stats, KeepAlive, Tokenize, Detokenize)
CLIENT_REQUEST_TAGS = frozenset(range(20, 28))  # the tags above


# ---- server -> client ----------------------------------------------------------------------------------


@record(30)
@dataclass(slots=True)
class Delta:
    """New tokens of a request. Streaming: one per step, ``text`` holds only the new complete characters (text
    that might still turn out to be part of a stop string is held back). Non-streaming: a single Delta with
    everything. The last Delta of a request has ``finish_reason`` ("stop", "length", "abort") and
    ``prompt_token_ids``."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: object | None = None  # the stop string or token id that ended it
    prompt_token_ids: list[int] | None = None  # on the last Delta only
    logprobs: list[TokenLogprobs] | None = None  # one per token in token_ids, when the request asked (logprobs=N)
    # on the last Delta, when the request asked (prompt_logprobs=N): one per prompt token after the first (which
    # nothing predicts; the client puts vLLM's None in its place)
    prompt_logprobs: list[PromptTokenLogprobs] | None = None
    num_prompt_tokens: int = 0  # on every Delta: a front-end whose client left mid-stream still counts the prompt


@record(35)
@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities around one generated token (the model's raw distribution, before penalties, temperature
    and filters): the sampled token first, then the N most likely tokens in descending order, the sampled one
    not repeated when it is among them. ``token_ids[i]`` has ``logprobs[i]``."""

    token_ids: list[int]
    logprobs: list[float]

    def as_dict(self) -> dict[int, float]:
        return dict(zip(self.token_ids, self.logprobs))

    @classmethod
    def from_dict(cls, d: dict[int, float]) -> TokenLogprobs:
        return cls(list(d), list(d.values()))


@record(36)
@dataclass(slots=True)
class PromptTokenLogprobs:
    """Log-probabilities at one prompt position (the model's raw distribution): the prompt token first, then the
    N most likely tokens in descending order (the prompt token not repeated when it is among them), each with
    its rank (1 = most likely) and its own text. Index i of every list is one token."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    decoded_tokens: list[str]

    def as_dict(self) -> dict[int, Logprob]:
        return {
            t: Logprob(lp, r, s) for t, lp, r, s in zip(self.token_ids, self.logprobs, self.ranks, self.decoded_tokens)
        }

    @classmethod
    def from_dict(cls, d: dict[int, Logprob]) -> PromptTokenLogprobs:
        lps = d.values()
        return cls(list(d), [e.logprob for e in lps], [e.rank for e in lps], [e.decoded_token or "" for e in lps])


@record(31)
@dataclass(slots=True)
class Error:
    """A request failed (or a frame was rejected); ``kind`` is one of ERROR_KINDS."""

    request_id: str
    kind: str
    message: str


@record(32)
@dataclass(slots=True)
class HealthReply:
    request_id: str
    healthy: bool
    message: str


@record(33)
@dataclass(slots=True)
class InfoReply:
    request_id: str
    protocol_version: int
    model: str
    max_model_len: int
    tensor_parallel_size: int
    device: str
    vocab_size: int
    block_size: int
    kv_blocks_total: int
    kv_capacity_tokens: int
    max_num_seqs: int
    worker_pids: list[int]  # spawned workers only (empty with external workers)
    coordinator_pid: int
    # sampling defaults from the model's generation_config.json (SamplingParams field -> value), for fields a
    # request leaves unset (the HTTP front-end applies them, as vLLM does)
    generation_defaults: object | None = None  # dict
    max_message_bytes: int | None = None  # the largest request frame the server takes (--max-message-bytes)
    max_pending_per_client: int | None = None  # requests one client may have pending (--max-pending-per-client)
    # seconds a connection with requests pending may send nothing before they are aborted (0: never)
    client_heartbeat_timeout_s: float | None = None


@record(34)
@dataclass(slots=True)
class StatsReply:
    request_id: str
    healthy: bool
    running: int
    waiting: int
    pending: int  # requests the server holds (running + waiting + not yet scheduled)
    kv_blocks_total: int
    kv_blocks_free: int
    kv_usage: float  # fraction of KV blocks held by requests
    prefix_cache_hit_tokens: int
    prefix_cache_hit_rate: float  # cached prompt tokens / (cached + computed prompt tokens)
    prompt_tokens: int
    output_tokens: int
    tokens_per_s: float  # generated tokens per second over the last few seconds
    steps: int
    preemptions: int
    requests_finished: int  # every reason, aborts included
    requests_aborted: int
    requests_rejected: int
    frames_dropped: int  # client frames logged and dropped
    replies_dropped: int  # replies dropped: client gone or past its high-water mark
    clients_pending: int = 0  # clients (connection, Generate.client) with requests pending
    requests_rejected_per_client: int = 0  # Overloaded: the client was at --max-pending-per-client
    requests_aborted_client_silent: int = 0  # aborted: their connection sent nothing for the heartbeat timeout
    # speculative decoding (None/0 when off): verify rows, their draft tokens, accepted drafts, accepted per position
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] | None = None


@record(37)
@dataclass(slots=True)
class TokenizeReply:
    request_id: str
    token_ids: list[int]
    max_model_len: int
    token_strs: list[str] | None = None  # when asked (return_token_strs)


@record(38)
@dataclass(slots=True)
class DetokenizeReply:
    request_id: str
    text: str
    token_texts: list[str] | None  # each id's own text, when asked (per_token)
