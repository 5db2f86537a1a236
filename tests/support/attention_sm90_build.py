"""The attention path of W3 (benchmarks/throughput.py: 256 sequences of a shared 2,048-token prefix + 64 tokens) on
Qwen3-0.6B's shape (16 q heads, 8 kv heads, head_dim 128, a bf16 cache of 16-token pages), built for an H100
(sm_90a) on any machine, no GPU needed: the host launchers run over "meta" tensors and every kernel they launch is
compiled with the specialization the JIT's own binder gives those arguments (benchmarks/sm90_build.py
``launch_builds``), with the tiles TritonAttentionBackend picks on 132 SMs. One line per build (registers, spills,
SASS instructions, the longest loop's, 16-byte cache accesses), non-zero exit if a check fails:

- each cache's stride tuple (``page_strides``) reaches the kernel as the scalar strides did before d8c987d: every
  element 16-divisible or, the unit stride, a constant (without it the K/V tiles lose their 16-byte accesses);
- every K/V tile read is a 16-byte asynchronous copy, every row a store kernel writes a 16-byte store;
- no spills, no value-at-a-time loads (``check_vector_loads``).

Compiled with Triton 3.6 at 1dfbc3e (scalar strides) and after d8c987d (stride tuples) these builds were instruction
for instruction the same SASS (docs/PERFORMANCE_LOG.md, the W3 prefix-caching regression). ``--sass-dir DIR``
writes each build's SASS there, to diff two commits.

    python -m tests.support.attention_sm90_build [--sass-dir DIR]      (TRITON_INTERPRET unset)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from benchmarks.sm90_build import MAX_SUBWORD_LOADS, check_vector_loads, launch_builds, sass_profile
from kernels import attention_decode, attention_flat, attention_prefill, attention_store, qk_norm_rope
from kernels.attention import AttentionMetadata
from kernels.triton_attention import TritonAttentionBackend

H100_SMS, Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 132, 16, 8, 128, 16
PREFIX, UNIQUE = 2048, 64
BLOCKS = 256 * (PREFIX + UNIQUE + 128) // PAGE
DEVICE_ONLY = {"USE_PDL": True, "launch_pdl": True}  # what a launch on an H100 passes (a CPU tensor turns PDL off)
STRIDE_TUPLES = ("k_strides", "v_strides")
# Triton 3.6 (the device's) broadcasts the 1-D cos/sin and norm weights into an 8-head tile through shared memory:
# 20 two-byte loads a thread, each a value that thread uses (tests/support/fp8_sm90_build.py; Triton 3.9: none)
SUBWORD_LOADS = {"qk norm + RoPE + store": 20}


def _tensor(*shape: int, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def _caches() -> tuple[torch.Tensor, torch.Tensor]:
    return _tensor(BLOCKS, PAGE, KV_HEADS, HEAD_DIM), _tensor(BLOCKS, PAGE, KV_HEADS, HEAD_DIM)


def _decode(batch: int):
    """Decode at ``batch`` sequences of W3's context, with the split count and tiles the backend picks."""
    policy = TritonAttentionBackend()
    context = PREFIX + UNIQUE
    splits = policy.num_decode_splits(batch, KV_HEADS, context, torch.device("meta"), sms=H100_SMS)
    tiles = policy.cuda_decode_tiles(batch, KV_HEADS, splits, HEAD_DIM, 2, H100_SMS)
    k_cache, v_cache = _caches()
    meta = AttentionMetadata(
        slot_mapping=_tensor(batch, dtype=torch.int64),
        num_prefill_tokens=0,
        num_prefills=0,
        num_decodes=batch,
        decode_seq_lens=_tensor(batch, dtype=torch.int32),
        decode_block_tables=_tensor(batch, context // PAGE + 8, dtype=torch.int32),
        max_decode_seq_len=context,
    )
    backend = TritonAttentionBackend(decode_tiles=tiles)
    q = _tensor(batch, Q_HEADS, HEAD_DIM)
    label = f"decode, batch {batch}: {splits} split(s), tiles {','.join(map(str, tiles))}"
    return label, lambda: backend.decode(q, k_cache, v_cache, meta, 0.088, num_splits=splits)


def _prefill(sequences: int):
    """A prefill step of W3 with caching on: each sequence's 64 new tokens over its cached 2,048-token prefix."""
    k_cache, v_cache = _caches()
    tokens = sequences * UNIQUE
    meta = AttentionMetadata(
        slot_mapping=_tensor(tokens, dtype=torch.int64),
        num_prefill_tokens=tokens,
        num_prefills=sequences,
        num_decodes=0,
        cu_seqlens_q=_tensor(sequences + 1, dtype=torch.int32),
        prefill_seq_lens=_tensor(sequences, dtype=torch.int32),
        prefill_block_tables=_tensor(sequences, (PREFIX + UNIQUE) // PAGE + 8, dtype=torch.int32),
        max_seqlen_q=UNIQUE,
    )
    backend = TritonAttentionBackend(prefill_tiles=TritonAttentionBackend.cuda_prefill_tiles(HEAD_DIM))
    q = _tensor(tokens, Q_HEADS, HEAD_DIM)
    return lambda: backend.prefill(q, k_cache, v_cache, meta, 0.088)


def _whole_step(sequences: int):
    """A graph-held mixed step: ``sequences`` chunks of W3's 64 tokens over the cached prefix, in one launch."""
    k_cache, v_cache = _caches()
    tokens, seqs = sequences * UNIQUE, _tensor(sequences + 1, dtype=torch.int32)
    q, table = _tensor(tokens, Q_HEADS, HEAD_DIM), _tensor(sequences, (PREFIX + UNIQUE) // PAGE + 8, dtype=torch.int32)
    work = _tensor(2, dtype=torch.int32)
    return lambda: attention_flat.whole_step_attention(
        q, k_cache, v_cache, seqs, seqs, table, work, 0.088, _tensor(tokens, Q_HEADS, HEAD_DIM), 256, 2 * H100_SMS
    )


def _stores(tokens: int):
    """The token's K/V into the cache: the q/k norm + RoPE kernel's store (Qwen3's path) and the plain one."""
    k_cache, v_cache = _caches()
    qkv = _tensor(tokens, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM).view(tokens, Q_HEADS + 2 * KV_HEADS, HEAD_DIM)
    qk, v = qkv[:, : Q_HEADS + KV_HEADS], qkv[:, Q_HEADS + KV_HEADS :]
    slots, weight = _tensor(tokens, dtype=torch.int64), _tensor(HEAD_DIM)
    cos_sin, positions = _tensor(40960, HEAD_DIM, dtype=torch.float32), _tensor(tokens, dtype=torch.int64)
    store = qk_norm_rope.KVStore(v, k_cache, v_cache, slots)

    def launch() -> None:
        qk_norm_rope.qk_norm_rope_(qk, weight, weight, 1e-6, cos_sin, positions, Q_HEADS, store)
        attention_store.store_kvcache(qkv[:, Q_HEADS : Q_HEADS + KV_HEADS], v, k_cache, v_cache, slots)

    return launch


def cases():
    """(label, {kernel label: JIT function}, launch, reads the cache in tiles)."""
    split, merge = attention_decode._decode_split_kernel, attention_decode._decode_merge_kernel
    for batch in (256, 64):  # W3's batch (one split, 128-key tiles) and the mid regime (64-key splits, a merge)
        label, launch = _decode(batch)
        yield label, {"split decode": split, "merge": merge}, launch, True
    yield "prefill, 64 tokens over a cached prefix", {"prefill": attention_prefill._prefill_kernel}, _prefill(16), True
    yield "whole step, 16 x 64 tokens", {"whole step": attention_flat._whole_step_kernel}, _whole_step(16), True
    kernels = {
        "qk norm + RoPE + store": qk_norm_rope._qk_norm_rope_kernel,
        "store": attention_store._store_kvcache_kernel,
    }
    for tokens in (256, 1024):  # a decode step's rows (one program a token), a prefill's (programs of 8 heads)
        yield f"KV stores, {tokens} tokens", kernels, _stores(tokens), False


def check(build: dict, tiles: bool, subword_loads: int = MAX_SUBWORD_LOADS) -> dict:
    """``sass_profile`` of ``build``; raises naming the first check it fails."""
    profile = sass_profile(build["sass"])
    names = build["arg_names"]
    for name in STRIDE_TUPLES if "k_strides" in names else ():
        i = names.index(name)
        loose = [j for j in range(4) if (i, j) not in build["hinted"] and (i, j) not in build["constants"]]
        if loose:
            raise RuntimeError(f"{name}[{loose}] reach the kernel without the 16-divisibility hint")
    if build["spill"]:
        raise RuntimeError(f"{build['spill']} bytes of spill stores")
    check_vector_loads(build["ptx"], subword_loads)
    if tiles and not 0 < profile["ldgsts_wide"] == profile["ldgsts"]:
        raise RuntimeError(f"K/V tiles: {profile['ldgsts_wide']} of {profile['ldgsts']} async copies 16 bytes wide")
    if not tiles and profile["stg_wide"] != profile["stg"]:
        raise RuntimeError(f"cache rows: {profile['stg_wide']} of {profile['stg']} stores 16 bytes wide")
    return profile


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--sass-dir", help="write each build's SASS here (to diff two commits' builds)")
    args = parser.parse_args()
    print(
        f"{'build':58s} {'regs':>4s} {'spill':>5s} {'per SM':>6s} {'instrs':>6s} {'loop':>5s} {'16B copies':>10s}"
        f" {'16B stores':>10s}"
    )
    failed = 0
    for label, kernels, launch, tiles in cases():
        builds = launch_builds(kernels, launch, DEVICE_ONLY)
        for name, build in builds.items():
            row = f"{label} / {name}"
            try:
                p = check(build, tiles and name != "merge", SUBWORD_LOADS.get(name, MAX_SUBWORD_LOADS))
            except Exception as e:  # report every build, then fail
                failed += 1
                print(f"FAILED  {row}: {type(e).__name__}: {e}", flush=True)
                continue
            copies, stores = f"{p['ldgsts_wide']}/{p['ldgsts']}", f"{p['stg_wide']}/{p['stg']}"
            print(
                f"{row:58s} {build['regs']:4d} {build['spill']:5d} {build['per_sm']:6d} {p['instrs']:6d} {p['loop']:5d}"
                f" {copies:>10s}"
                f" {stores:>10s}",
                flush=True,
            )
            if args.sass_dir:
                os.makedirs(args.sass_dir, exist_ok=True)
                path = os.path.join(args.sass_dir, "".join(c if c.isalnum() else "_" for c in row) + ".sass")
                with open(path, "w") as f:
                    f.write(build["sass"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
