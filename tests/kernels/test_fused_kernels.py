"""Fused Triton kernels (kernels/fused.py) against the torch layer code they replace: on CUDA at real sizes, on the
CPU under TRITON_INTERPRET=1 at tiny sizes."""

import pytest
import torch

from kernels import fused
from kernels.qk_norm_rope import KVStore, qk_norm_rope_
from model.layers import RMSNorm
from model.rotary import RotaryEmbedding

ON_GPU = torch.cuda.is_available()  # without CUDA, conftest.py runs the kernels in the Triton interpreter
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16] if ON_GPU else [torch.float32]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def torch_norm(x, weight, eps, residual=None):
    layer = RMSNorm(x.shape[-1], eps).to(device=x.device, dtype=x.dtype)
    layer.weight.data.copy_(weight)
    if residual is None:
        return layer._norm(x)
    s = x + residual
    return layer._norm(s), s


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 1000] if not ON_GPU else [1024, 4096, 1000])
def test_rmsnorm_with_and_without_residual(dtype, width):
    g = torch.Generator(device=DEVICE).manual_seed(width)
    x = torch.randn(7, width, device=DEVICE, generator=g).to(dtype)
    r = torch.randn(7, width, device=DEVICE, generator=g).to(dtype)
    w = (torch.rand(width, device=DEVICE, generator=g) + 0.5).to(dtype)
    assert rel(fused.rmsnorm(x, w, 1e-6), torch_norm(x, w, 1e-6)) < TOL[dtype]
    out, res = fused.rmsnorm(x, w, 1e-6, r)
    ref_out, ref_res = torch_norm(x, w, 1e-6, r)
    assert torch.equal(res, ref_res)  # the residual sum is rounded exactly as torch rounds it
    assert rel(out, ref_out) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "q_heads,k_heads,head_dim", [(4, 2, 16), (3, 1, 32)] if not ON_GPU else [(16, 8, 128), (32, 8, 128), (5, 5, 64)]
)
def test_qk_norm_rope_in_place_on_the_qkv_projection(dtype, q_heads, k_heads, head_dim):
    g = torch.Generator(device=DEVICE).manual_seed(q_heads)
    tokens = 9
    qkv = torch.randn(tokens, (q_heads + 2 * k_heads) * head_dim, device=DEVICE, generator=g).to(dtype)
    v_before = qkv[:, (q_heads + k_heads) * head_dim :].clone()
    qk = qkv[:, : (q_heads + k_heads) * head_dim].view(tokens, q_heads + k_heads, head_dim)  # strided, as in qwen3
    q_in, k_in = qk[:, :q_heads].clone(), qk[:, q_heads:].clone()
    wq = (torch.rand(head_dim, device=DEVICE, generator=g) + 0.5).to(dtype)
    wk = (torch.rand(head_dim, device=DEVICE, generator=g) + 0.5).to(dtype)
    rope = RotaryEmbedding(head_dim, 4096, 1e6).to(DEVICE)
    positions = torch.randint(0, 4096, (tokens,), device=DEVICE, generator=g)
    qk_norm_rope_(qk, wq, wk, 1e-6, rope.cos_sin, positions, q_heads)
    ref_q, ref_k = rope(positions, torch_norm(q_in, wq, 1e-6), torch_norm(k_in, wk, 1e-6))
    assert rel(qk[:, :q_heads], ref_q) < TOL[dtype] * 2
    assert rel(qk[:, q_heads:], ref_k) < TOL[dtype] * 2
    assert torch.equal(qkv[:, (q_heads + k_heads) * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads,k_heads,head_dim", [(4, 2, 16), (3, 1, 32)] if not ON_GPU else [(16, 8, 128)])
def test_qk_norm_rope_writes_k_and_v_into_the_paged_cache(dtype, q_heads, k_heads, head_dim):
    g = torch.Generator(device=DEVICE).manual_seed(7)
    tokens, num_blocks, block_size = 6, 4, 4
    qkv = torch.randn(tokens, (q_heads + 2 * k_heads) * head_dim, device=DEVICE, generator=g).to(dtype)
    qk = qkv[:, : (q_heads + k_heads) * head_dim].view(tokens, q_heads + k_heads, head_dim)
    v = qkv[:, (q_heads + k_heads) * head_dim :].view(tokens, k_heads, head_dim)  # strided, as in qwen3
    q_in, k_in = qk[:, :q_heads].clone(), qk[:, q_heads:].clone()
    wq = (torch.rand(head_dim, device=DEVICE, generator=g) + 0.5).to(dtype)
    wk = (torch.rand(head_dim, device=DEVICE, generator=g) + 0.5).to(dtype)
    rope = RotaryEmbedding(head_dim, 64, 1e6).to(DEVICE)
    positions = torch.arange(tokens, device=DEVICE) + 3
    slots = torch.tensor([5, 0, -1, 15, 9, 2], device=DEVICE)  # -1: a padding token, nothing written
    shape = (num_blocks, block_size, k_heads, head_dim)
    k_cache = torch.full(shape, 7.0, dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, 7.0, dtype=dtype, device=DEVICE)
    qk_norm_rope_(qk, wq, wk, 1e-6, rope.cos_sin, positions, q_heads, KVStore(v, k_cache, v_cache, slots))
    ref_q, ref_k = rope(positions, torch_norm(q_in, wq, 1e-6), torch_norm(k_in, wk, 1e-6))
    assert rel(qk[:, :q_heads], ref_q) < TOL[dtype] * 2
    kc, vc = k_cache.view(-1, k_heads, head_dim), v_cache.view(-1, k_heads, head_dim)
    live = slots >= 0
    assert torch.equal(kc[slots[live]], qk[live, q_heads:])  # exactly the K left in qk, at each token's slot
    assert torch.equal(vc[slots[live]], v[live])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots[live]] = False
    assert (kc[untouched] == 7).all() and (vc[untouched] == 7).all()


@pytest.mark.parametrize("scaled", [False, True], ids=["finished", "fp8-scaled"])
@pytest.mark.parametrize("kv_fp8", [False, True], ids=["bf16-cache", "e4m3-cache"])
def test_qk_norm_rope_head_blocks_give_the_one_program_bits(scaled, kv_fp8, monkeypatch):
    """Many tokens (prefill) run programs of 8 q/k heads and of 8 v heads; few run one program a token. The same
    bits either way: q in place, K and V in either cache, with the FP8 product's scales."""
    from kernels import qk_norm_rope
    from kernels.attention import value_cache

    g = torch.Generator().manual_seed(11)
    q_heads, k_heads, head_dim, tokens = 10, 9, 16, 6  # 19 q/k heads and 9 v heads: partly filled blocks
    width = (q_heads + 2 * k_heads) * head_dim
    qkv = torch.randn(tokens, width, generator=g).bfloat16().to(DEVICE)
    scales = (torch.rand(tokens, generator=g).to(DEVICE), torch.rand(width, generator=g).to(DEVICE)) if scaled else None
    w = (torch.rand(head_dim, generator=g) + 0.5).bfloat16().to(DEVICE)
    rope = RotaryEmbedding(head_dim, 64, 1e6).to(DEVICE)
    positions, slots = torch.arange(tokens, device=DEVICE) + 2, torch.tensor([5, 0, -1, 15, 9, 2], device=DEVICE)
    results = []
    for blocks_from in (tokens + 1, 1):  # one program a token, then head blocks
        monkeypatch.setattr(qk_norm_rope, "_SMALL_BLOCKS_FROM", blocks_from)
        x = qkv.clone()
        qk = x[:, : (q_heads + k_heads) * head_dim].view(tokens, q_heads + k_heads, head_dim)
        v = x[:, (q_heads + k_heads) * head_dim :].view(tokens, k_heads, head_dim)
        k_cache = torch.zeros(4, 4, k_heads, head_dim, device=DEVICE).to(torch.float8_e4m3fn if kv_fp8 else qkv.dtype)
        v_cache = value_cache(torch.zeros_like(k_cache))
        store = KVStore(v, k_cache, v_cache, slots, 0.5 if kv_fp8 else 1.0, 2.0 if kv_fp8 else 1.0)
        qk_norm_rope_(qk, w, w, 1e-6, rope.cos_sin, positions, q_heads, store, scales)
        results.append([x, k_cache.view(torch.uint8), v_cache.view(torch.uint8)])
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert results[0][2].any() and not torch.equal(results[0][0], qkv)  # V stored, q/k written


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    n = 3072 if ON_GPU else 96
    x = torch.randn(5, 2 * n, device=DEVICE, generator=g).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    assert rel(fused.silu_and_mul(x), torch.nn.functional.silu(gate) * up) < TOL[dtype]
    assert fused.silu_and_mul(x[:0]).shape == (0, n)


@pytest.mark.parametrize("copy_in", [True, False])
def test_one_shot_all_reduce_norm_at_one_rank(copy_in):
    # kernels/allreduce_norm.py's arithmetic with no peer (the barrier has no one to meet): add + norm of x itself
    from kernels.allreduce_norm import allreduce_add_rmsnorm

    g = torch.Generator(device=DEVICE).manual_seed(7)
    rows, width = 9, 64
    buf = torch.zeros(2 * rows * width, device=DEVICE)  # two halves; this call uses the second
    pads = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    ptrs = torch.tensor([buf.data_ptr()], dtype=torch.int64, device=DEVICE)
    pad_ptrs = torch.tensor([pads.data_ptr()], dtype=torch.int64, device=DEVICE)
    x = torch.randn(rows, width, device=DEVICE, generator=g)
    if not copy_in:  # the projection wrote its output into the half already
        buf[rows * width :].copy_(x.view(-1))
        x = buf[rows * width :].view(rows, width)
    residual = torch.randn(rows, width, device=DEVICE, generator=g)
    w = torch.rand(width, device=DEVICE, generator=g) + 0.5
    for max_programs in (4, 2):  # one row per tile, then two
        out, res_out = allreduce_add_rmsnorm(
            x, residual, w, 1e-6, ptrs, pad_ptrs, rows * width, 0, 1, max_programs, copy_in
        )
        ref_out, ref_res = torch_norm(x, w, 1e-6, residual)
        assert torch.equal(res_out, ref_res)
        assert rel(out, ref_out) < TOL[torch.float32]
        assert torch.equal(buf[rows * width :].view(rows, width), x)  # this rank's rows are in its buffer half
        assert not pads.any()  # no flag left set


def _rank_process(rank, world, bufs, pads, xs, residual, w, queue):
    """One rank of test_one_shot_all_reduce_norm_across_rank_processes: three calls (buffer halves A, B, A)."""
    from kernels.allreduce_norm import allreduce_add_rmsnorm

    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)  # every rank's buffer, as mapped here
    pad_ptrs = torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64)
    half = bufs[0].numel() // 2
    results = []
    for call, x in enumerate(xs):
        out, res = allreduce_add_rmsnorm(x[rank], residual, w, 1e-6, ptrs, pad_ptrs, (call % 2) * half, rank, world, 2)
        results.append((out.numpy().copy(), res.numpy().copy()))
    queue.put((rank, results))


@pytest.mark.skipif(ON_GPU, reason="ranks simulated as processes sharing host memory, in the Triton interpreter")
@pytest.mark.parametrize("world", [2, 3])
def test_one_shot_all_reduce_norm_across_rank_processes(world):
    # The real protocol: each rank a process running the kernel on its own rows; the "symmetric" buffers and
    # signal pads are shared memory mapped at the same address in every process (fork), as peer memory is on
    # GPUs. Exercises the per-program barrier, the peers' rows, the rank-order sum and the alternating halves; a
    # broken barrier hangs (the queue times out) or sums stale rows.
    import multiprocessing

    rows, width, calls = 6, 32, 3
    bufs = [torch.zeros(2 * rows * width).share_memory_() for _ in range(world)]
    pads = [torch.zeros(64, dtype=torch.int32).share_memory_() for _ in range(world)]
    g = torch.Generator().manual_seed(world)
    xs = [torch.randn(world, rows, width, generator=g) for _ in range(calls)]
    residual = torch.randn(rows, width, generator=g)
    w = torch.rand(width, generator=g) + 0.5
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    args = (world, bufs, pads, xs, residual, w, queue)
    procs = [ctx.Process(target=_rank_process, args=(r, *args)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = dict(queue.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    for call, x in enumerate(xs):
        total = torch.zeros(rows, width)
        for q in range(world):
            total = total + x[q]
        ref_out, ref_res = torch_norm(total, w, 1e-6, residual)
        for rank in range(world):
            out, res = got[rank][call]
            assert torch.equal(torch.from_numpy(res), ref_res), (rank, call)  # the same bits on every rank
            assert rel(torch.from_numpy(out), ref_out) < TOL[torch.float32]
    assert not any(p.any() for p in pads)  # every flag taken back
