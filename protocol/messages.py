"""Every message between nanoserve's processes. Wire format: protocol/codec.py."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.codec import F32, I32, I64, record

# ZMTP heartbeats between coordinator and workers, answered by ZMQ's I/O threads (so a long step never misses
# one): a peer silent this long is disconnected, which both sides watch for (workers on other hosts included).
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000

PROTOCOL_VERSION = 1


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
    """Coordinator -> worker: allocate this many blocks (the minimum over ranks), then capture graphs."""

    num_blocks: int


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
    (block table, computed length, sampling controls), so a step carries only what changed.

    Scheduled sequences are listed prefill-first (num_tokens > 1), then single-token ones.
    """

    step_id: int
    slots: I32  # [n] slot of each scheduled sequence
    num_tokens: I32  # [n] tokens computed this step
    token_ids: I32  # [sum(num_tokens)] input tokens, concatenated
    new_block_counts: I32  # [n] blocks appended to each sequence's table before this step
    new_block_ids: I32  # [sum(new_block_counts)]
    sample_rows: I32  # indices into the n sequences whose last token is sampled
    # sequences that start (or restart after preemption) in a slot this step
    new_slots: I32
    new_start_pos: I32  # first position computed (> 0 after a prefix-cache hit)
    new_temperature: F32
    new_top_p: F32
    new_top_k: I32
    new_min_p: F32
    new_seed: I64  # -1 = unseeded
    freed_slots: I32  # sequences that finished or were preempted since the last step


@record(8)
@dataclass(slots=True)
class StepResult:
    """Rank 0 -> coordinator: sampled token ids, one per ``sample_rows`` entry. Other ranks send it empty."""

    step_id: int
    rank: int
    token_ids: I32


@record(9)
@dataclass(slots=True)
class Shutdown:
    reason: str
