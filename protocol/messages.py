"""Every message between nanoserve's processes. Wire format: protocol/codec.py."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.codec import F32, I32
from protocol.records import record
from protocol.sampling_params import SamplingParams

# 4: SamplingParams.logit_bias / prompt_logprobs, StepResult's prompt logprobs; 5: SamplingParams.truncate_prompt_tokens
# 6: SamplingParams.structured_outputs, StepCommand's token masks; 7: StepMasks; 8: worker authentication
# (WorkerHello.nonce, AuthChallenge, AuthResponse); 9: SamplingParams travels sparse (its non-default fields by name)
PROTOCOL_VERSION = 12  # 12: the EOS ids travel in AllocateKV (the config leaves before the tokenizer loads)
# StepCommand.token_ids: -1 is the token this worker sampled last for the slot (async scheduling); DRAFT_PLACEHOLDER
# marks a verify row's draft position that the worker fills from its own draft model (EAGLE-3)
DRAFT_PLACEHOLDER = -2


# ---- coordinator <-> worker --------------------------------------------------------------------------


@record(1)
@dataclass(slots=True)
class WorkerHello:
    """Worker -> coordinator, first message after connecting."""

    protocol_version: int
    rank: int
    world_size: int
    device: str
    pid: int
    hostname: str
    nonce: bytes = b""  # random; the coordinator's proof that it holds the worker secret covers it


@record(12)
@dataclass(slots=True)
class AuthChallenge:
    """Coordinator -> worker, in answer to its hello when the coordinator has a worker secret: a fresh nonce, and
    the coordinator's proof (protocol/worker_auth.py) that it holds the secret too."""

    nonce: bytes
    proof: bytes


@record(13)
@dataclass(slots=True)
class AuthResponse:
    """Worker -> coordinator: its proof over both nonces; empty, with the reason, when it gives none (it has no
    secret, or the coordinator's proof did not verify: a proof made for an unverified coordinator would let it test
    guesses of the secret offline)."""

    rank: int
    proof: bytes
    refusal: str = ""


@record(2)
@dataclass(slots=True)
class WorkerConfig:
    """Coordinator -> worker: what to load and how to size the KV pool."""

    model: str
    device: str  # "cpu" or "cuda" (each rank uses cuda:LOCAL_RANK)
    dtype: str
    load_format: str
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    num_kv_blocks: int  # -1: size from memory
    gpu_memory_utilization: float
    kv_cache_memory_bytes: int  # CPU budget when num_kv_blocks is -1
    enforce_eager: bool
    seed: int
    attention_backend: str
    dist_init_method: str  # "" = take the rendezvous from the environment (torchrun)
    quantization: str = ""  # "fp8": quantize a 16-bit checkpoint's linear layers at load (model/fp8_linear.py)
    kv_cache_dtype: str = "auto"  # "auto" = dtype; "fp8": the KV pool stores e4m3
    draft_model: str = ""  # speculative decoding with EAGLE-3: the draft checkpoint's directory, "" = none


@record(3)
@dataclass(slots=True)
class WorkerReady:
    """Worker -> coordinator after loading weights: how many KV blocks fit on this rank."""

    rank: int
    num_kv_blocks: int
    kv_block_bytes: int
    device_name: str


@record(4)
@dataclass(slots=True)
class AllocateKV:
    """Coordinator -> worker: allocate this many blocks (the minimum over ranks), then capture graphs. The EOS ids
    come here, not in the config: the coordinator sends the config before it loads the tokenizer (seconds of
    imports on a GPU host), which it does while the workers load weights and size their pools."""

    num_blocks: int
    eos_token_ids: list[int]  # masked (unless ignore_eos) while a sequence's min_tokens are pending


@record(5)
@dataclass(slots=True)
class WorkerAck:
    rank: int
    what: str


@record(6)
@dataclass(slots=True)
class WorkerError:
    """Worker -> coordinator: a fatal error on this rank (load failure, OOM, bad step)."""

    rank: int
    message: str


@record(7)
@dataclass(slots=True)
class StepCommand:
    """Coordinator -> every worker, once per step. Workers keep each running sequence's state in a *slot*
    (block table, computed length, sampling state), so a step carries only what changed.

    Scheduled sequences are listed prefill-first: the leading ``len(prefill_num_tokens)`` rows compute more than
    one token each, every later row computes exactly one (a decode, or a one-token prefill chunk). Every row's
    last token is sampled except those in ``skip_sample_rows`` (chunks that end inside a prompt), so a decode
    step carries three int32 per sequence: slot, input token, new-block count.

    A sequence that starts (or restarts after a preemption) in a slot brings its ``SamplingParams`` and the
    facts only the coordinator knows: the outputs it already has and, under a repetition penalty or while its
    prompt logprobs are still to compute (no outputs yet), its prompt.
    The worker derives everything else (min_tokens still pending, masked ids, seeds) from the record.
    """

    step_id: int
    slots: I32  # [n] slot of each scheduled sequence
    prefill_num_tokens: I32  # [p] tokens computed by each of the first p rows (all > 1); rows p.. compute 1
    token_ids: I32  # [sum of tokens] input tokens, concatenated
    new_block_counts: I32  # [n] blocks appended to each sequence's table before this step
    new_block_ids: I32  # [sum(new_block_counts)]
    skip_sample_rows: I32  # rows whose last token is NOT sampled (partial prefill chunks), ascending
    # sequences that start (or restart after preemption) in a slot this step, one entry each
    new_slots: I32
    new_start_pos: I32  # first position computed (> 0 after a prefix-cache hit)
    new_params: list[SamplingParams]
    new_num_outputs: I32  # output tokens it already has (> 0 only after a preemption)
    new_prompt_lens: I32  # prompt ids in new_past_token_ids (a repetition penalty or prompt logprobs need them; else 0)
    # per new sequence, concatenated: new_prompt_lens[i] prompt ids, then its new_num_outputs[i] outputs so far
    new_past_token_ids: I32
    freed_slots: I32  # sequences that finished or were preempted since the last step
    # structured outputs: the sampled rows (indices among the step's sampled rows) whose tokens are masked, and
    # their bitmasks, [len(mask_rows), ceil(vocab / 32)] flattened (token i allowed: bit i % 32 of word i // 32).
    # token_masks None with mask_rows set: the bitmasks follow in a StepMasks, once the coordinator has the tokens
    # of the steps before this one (async scheduling); rank 0 runs the forward meanwhile and samples after.
    mask_rows: I32 | None = None
    token_masks: I32 | None = None
    # speculative decoding: per leading multi-token row (as prefill_num_tokens), how many of its trailing tokens are
    # draft tokens (0: a prompt chunk). A row with d > 0 is a verify row, [last token, d drafts]: the worker scores
    # all d + 1 positions, keeps the drafts the target accepts and adds one token of its own (StepResult.num_accepted)
    draft_counts: I32 | None = None


@record(11)
@dataclass(slots=True)
class StepMasks:
    """Coordinator -> rank 0: the token bitmasks of a step sent with ``mask_rows`` but no ``token_masks``."""

    step_id: int
    token_masks: I32  # as StepCommand.token_masks


@record(8)
@dataclass(slots=True)
class StepResult:
    """Rank 0 -> coordinator: sampled token ids, one per sampled row (all rows but ``skip_sample_rows``). Other
    ranks send it empty.

    Logprobs (None when no sampled row asked for them): for each sampled row whose sequence has logprobs=N, in
    row order, 1 + N entries: the sampled token, then the N most likely tokens in descending order, with their
    log-probabilities under the model's raw distribution (before logit bias, penalties, temperature and filters).

    Prompt logprobs (None when no row of the step computed prompt tokens of a sequence with prompt_logprobs=N):
    per prompt position returned, in step order, a (step row, position in the prompt, rank of the prompt token)
    triple in ``prompt_logprob_index`` and 1 + N entries: the prompt token, then the N most likely tokens."""

    step_id: int
    rank: int
    token_ids: I32
    logprob_token_ids: I32 | None = None
    logprobs: F32 | None = None
    prompt_logprob_index: I32 | None = None  # [3 * positions] (row, position, rank) triples
    prompt_logprob_token_ids: I32 | None = None
    prompt_logprobs: F32 | None = None
    # with verify rows in the step: per sampled row, the drafts accepted (0..d); token_ids then holds 1 + that many
    # tokens a row (the accepted drafts, then the target's own), and logprobs follow the same tokens
    num_accepted: I32 | None = None


@record(9)
@dataclass(slots=True)
class Shutdown:
    reason: str
