"""What a worker does once, before its first step: size the KV pool (on CUDA by profiling the largest prefill the
limits allow), then, once the coordinator has fixed the pool, allocate it, compile the data-dependent kernels,
pick cuBLASLt algorithms for the decode graphs' products (stored across starts: kernels/tune_cache.py), capture the
CUDA graphs and warm the prefill path. Each part's seconds go to this process's start-up phases
(settings/startup_phases.py), which the worker reports at ready."""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from comm.parallel import tp_rank, tp_size
from kernels import cublaslt_tune
from kernels.attention import AttentionMetadata
from kernels.decode_gemm import decode_linear_tiles
from kernels.sampling import warmup as sampling_warmup
from kernels.triton_attention import TritonAttentionBackend
from kernels.tune_cache import TuneCache
from model.linear import LinearBase
from settings.env import settings
from settings.startup_phases import PHASES
from worker.cuda_graphs import DecodeGraphs, batch_buckets
from worker.model_runner import ModelRunner
from worker.prefill_graphs import PrefillGraphs, WholeStepInputs

# seconds of cuBLASLt timing a start may spend (a cold start's 73 products took 18 s of a Qwen3-8B start, log 53, for
# +0.3-0.7% of W1): products not reached keep torch's matmul and are timed by the next starts (kernels/tune_cache.py)
TUNE_BUDGET_S = 5.0


def available_kv_blocks(runner: ModelRunner) -> int:
    """How many blocks fit on this rank: explicit count, CPU budget, or measured CUDA headroom."""
    cfg = runner.cfg
    useful = cfg.max_num_seqs * runner.block_tables.shape[1] + 1
    if cfg.num_kv_blocks > 0:
        return cfg.num_kv_blocks
    if runner.device.type != "cuda":
        return max(1, min(useful, cfg.kv_cache_memory_bytes // runner.kv_block_bytes))
    return _profile_cuda_blocks(runner)


def prepare_for_steps(runner: ModelRunner, num_blocks: int, eos_token_ids: list[int]) -> None:
    """The coordinator fixed the pool (the minimum over ranks) and sent the model's EOS ids (known once its
    tokenizer loaded): allocate the pool and get every kernel and graph ready."""
    runner.sampling.eos_token_ids = frozenset(eos_token_ids)
    with PHASES.phase("kv alloc"):
        runner.allocate_kv(num_blocks)
        _sync(runner)
    with PHASES.phase("kernel warmup"):
        warmup_kernels(runner)
    capture_graphs(runner)  # books "gemm tuning", "decode graphs" and "prefill graphs"
    with PHASES.phase("prefill warmup"):
        warm_prefill_pool(runner)


def _sync(runner: ModelRunner) -> None:
    if runner.device.type == "cuda":  # so a phase's time is its device work, not the next phase's
        torch.cuda.synchronize(runner.device)


# ---- KV sizing -------------------------------------------------------------------------------------------


def _profile_cuda_blocks(runner: ModelRunner) -> int:
    # Peak activation memory of a forward at the largest batch, then the seed's formula.
    device = runner.device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    num_seqs, seq_len, blocks_per_seq = _largest_prefill(runner)
    runner.allocate_kv(num_seqs * blocks_per_seq)
    _warmup_prefill(runner, num_seqs, seq_len, blocks_per_seq)
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    peak = torch.cuda.max_memory_allocated(device)
    current = torch.cuda.memory_allocated(device)
    kv_now = runner.kv_cache.numel() * runner.kv_cache.element_size()
    budget = total * runner.cfg.gpu_memory_utilization - (total - free) - (peak - current) + kv_now
    del runner.kv_cache
    torch.cuda.empty_cache()
    return max(0, int(budget) // runner.kv_block_bytes)


def _largest_prefill(runner: ModelRunner) -> tuple[int, int, int]:
    """(sequences, tokens each, blocks each) of the largest prefill step the limits allow."""
    cfg = runner.cfg
    tokens = min(cfg.max_num_batched_tokens, cfg.max_model_len * cfg.max_num_seqs)
    seq_len = min(cfg.max_model_len, tokens)
    return max(1, tokens // seq_len), seq_len, -(-seq_len // runner.block_size)


def _warmup_prefill(runner: ModelRunner, num_seqs: int, seq_len: int, blocks_per_seq: int) -> None:
    bs = runner.block_size
    tables = np.arange(num_seqs * blocks_per_seq, dtype=np.int32).reshape(num_seqs, blocks_per_seq)
    tokens = np.zeros(num_seqs * seq_len, dtype=np.int32)
    positions = np.tile(np.arange(seq_len), num_seqs)
    rows = np.repeat(np.arange(num_seqs), seq_len)
    slots = tables[rows, positions // bs] * bs + positions % bs
    lens, graphs = np.full(num_seqs, seq_len), runner.prefill_graphs
    with torch.inference_mode():
        if graphs is not None and graphs.holds(len(tokens), num_seqs):
            hidden = graphs.run(runner.stager, runner.to_dev(tokens), positions, slots, lens, lens, tables)
        else:
            meta = AttentionMetadata(runner.to_dev(slots), len(tokens), num_seqs, 0)
            runner.set_prefill_meta(meta, lens, lens, tables)
            hidden = runner.run_model(runner.to_dev(tokens), positions, meta)
        runner.model.compute_logits(hidden[-num_seqs:])


# ---- after the pool is allocated -------------------------------------------------------------------------


def warmup_kernels(runner: ModelRunner) -> None:
    """Compile the data-dependent Triton kernel variants (attention, sampling) before the first real step."""
    if runner.device.type != "cuda":
        return
    mc, cfg = runner.model_config, runner.cfg
    if hasattr(runner.backend, "warmup"):
        attn = runner.attn_layers[0]
        runner.backend.warmup(attn.k_cache, attn.v_cache, attn.num_heads, runner.dtype)
    sampling_warmup(mc.vocab_size, runner.dtype, runner.device)  # every rank samples its shard
    # The LM head runs eagerly, at the step's number of sampled rows (the decode graphs end at the hidden
    # states). Without this pass, each prefill step that sampled a row count not seen before blocked the host
    # for about the step's whole device time (cuBLAS loading that size's kernel on first use, we suspect).
    rows = torch.zeros(cfg.max_num_seqs, mc.hidden_size, dtype=runner.dtype, device=runner.device)
    with torch.inference_mode():
        for n in range(1, cfg.max_num_seqs + 1):
            runner.model.compute_logits(rows[:n])
            if tp_size() > 1:  # the shard sampler's product (the last shard may be narrower)
                runner.model.compute_shard_logits(rows[:n])
    torch.cuda.synchronize(runner.device)


def tune_decode_gemms(runner: ModelRunner) -> None:
    """Choose cuBLASLt algorithms for the layer products at each decode graph's row count, where one beats
    torch's pick (kernels/cublaslt_tune.py): at most TUNE_BUDGET_S of timing a start, read back from the cache
    dir (kernels/tune_cache.py) after that. NANOSERVE_LT_TUNE=0 keeps torch's matmul."""
    if not settings().lt_tune or runner.dtype not in (torch.bfloat16, torch.float16):
        return
    weights: dict[tuple[int, int], list[torch.Tensor]] = {}
    for module in runner.model.modules():
        if isinstance(module, LinearBase) and module.bias is None and module.quant is None:
            weights.setdefault(tuple(module.weight.shape), []).append(module.weight)
    start = time.perf_counter()
    cache = TuneCache("cublaslt", cublaslt_tune.cache_key(runner.device))
    with torch.inference_mode():
        records = cublaslt_tune.tune(
            weights,
            batch_buckets(runner.cfg.max_num_seqs),
            skip=lambda x, w: decode_linear_tiles(x, w) is not None,
            cache=cache,
            budget_s=TUNE_BUDGET_S,
        )
    torch.cuda.synchronize(runner.device)
    if tp_rank() == 0:  # what the tuning predicts for a step's layer products, per row count
        took = time.perf_counter() - start
        stored = f"{cache.hits} of {cache.hits + cache.misses + cache.deferred} read from {cache.path}"
        stored += f", {cache.deferred} left for a later start" if cache.deferred else ""
        summary = cublaslt_tune.summary(records)
        print(f"nanoserve[gemm tuning] ({took:.1f} s, {stored}): {summary}", file=sys.stderr, flush=True)


def capture_graphs(runner: ModelRunner) -> None:
    """CUDA graphs for decode-only steps and, at TP 1 with the Triton backend, whole-forward ones for steps with
    prefill tokens (after the KV pool exists); no-op on CPU or with enforce_eager."""
    cfg = runner.cfg
    if runner.device.type != "cuda" or cfg.enforce_eager:
        return
    with PHASES.phase("gemm tuning"):
        tune_decode_gemms(runner)
    runner.graphs = DecodeGraphs(
        runner.model,
        runner.backend,
        max_batch=cfg.max_num_seqs,
        max_blocks=runner.block_tables.shape[1],
        max_seq_len=cfg.max_model_len,
        hidden_size=runner.model_config.hidden_size,
        dtype=runner.dtype,
        device=runner.device,
    )
    PHASES.mark("decode graphs")
    if runner.drafter is not None:  # the EAGLE-3 draft's forwards, in the decode graphs' memory pool
        runner.drafter.capture_graphs(runner.graphs.pool)
        PHASES.mark("draft graphs")
    # The whole-step attention is the Triton backend's kernel. Under tensor parallelism the prefill-sized
    # all-reduces would be NCCL collectives inside graphs, not yet checked on the device; TP prefill steps are
    # device-bound anyway, so graphs would save little there.
    if isinstance(runner.backend, TritonAttentionBackend) and tp_size() == 1:
        runner.prefill_graphs = PrefillGraphs(runner.model, runner_inputs(runner), runner.backend.store_kvcache)
        PHASES.mark("prefill graphs")


def runner_inputs(runner: ModelRunner) -> WholeStepInputs:
    """The static inputs for ``runner``'s steps: its token budget, sequences, block-table width and attention shape."""
    attn, cfg = runner.attn_layers[0], runner.cfg
    return WholeStepInputs(
        cfg.max_num_batched_tokens,
        cfg.max_num_seqs,
        runner.block_tables.shape[1],
        attn.num_heads,
        attn.num_kv_heads,
        attn.head_dim,
        runner.dtype,
        runner.device,
    )


def warm_prefill_pool(runner: ModelRunner) -> None:
    """The KV sizing's prefill once more, after graph capture and before the first real one: it compiles the
    prefill attention kernel, and either replays the prefill graphs once or leaves the eager activations'
    blocks in the caching allocator (the KV sizing released them)."""
    if runner.device.type != "cuda":
        return
    num_seqs, seq_len, blocks_per_seq = _largest_prefill(runner)  # the shape the KV sizing profiled
    num_seqs = min(num_seqs, runner.num_blocks // blocks_per_seq)
    if num_seqs == 0:
        return
    _warmup_prefill(runner, num_seqs, seq_len, blocks_per_seq)  # writes KV only into blocks no sequence owns yet
    torch.cuda.synchronize(runner.device)
