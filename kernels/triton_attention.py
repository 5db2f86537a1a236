"""Triton paged attention backend: launches the KV store (kernels/attention_store.py), variable-length prefill
(kernels/attention_prefill.py) and split-K decode (kernels/attention_decode.py) kernels.

Layout and metadata are those of :mod:`kernels.attention`; ``TorchAttentionBackend`` is the oracle.
The kernels run on CUDA and, for tests, on CPU tensors under ``TRITON_INTERPRET=1``.
They need Triton 3.4 or newer (programmatic dependent launch, kernels/pdl.py) and nothing newer than 3.6.

Launches never read device values on the host (no ``.item()`` / ``.tolist()``): grids come from tensor
shapes and host ints in the metadata, so decode can be captured in a CUDA graph.

The e4m3 (FP8) cache and its scales: kernels/attention_store.py.
"""

from __future__ import annotations

import torch
import triton

from kernels.attention import AttentionBackend, AttentionMetadata
from kernels.attention_decode import split_decode
from kernels.attention_prefill import _prefill_kernel
from kernels.attention_store import check_cache, dot_dtype_f16, kernel_scales, page_strides, store_kvcache
from kernels.device import num_sms
from kernels.pdl import use_pdl


class TritonAttentionBackend(AttentionBackend):
    """Triton paged attention.

    Metadata dtypes: ``slot_mapping`` int32 or int64; ``cu_seqlens_q``, ``prefill_seq_lens``,
    ``decode_seq_lens`` and both block tables int32 (int64 also works); block tables need a unit
    stride along the blocks dim. ``q``/``k``/``v`` may be strided views (e.g. slices of a fused qkv),
    but their head_dim must be contiguous.

    Decode splits the context over ``num_splits`` programs per (sequence, kv head), picked on the host
    from the batch size, the SM count and ``meta.max_decode_seq_len`` (capped by ``max_splits``). The
    kernel derives each split's range from the device-side seq_len, so any ``num_splits`` is correct
    for any lengths: a CUDA graph captured with one value replays correctly for all lengths.
    """

    # Decode regimes by programs per split (batch x kv heads), measured on an H200:
    # from DIRECT_PROGRAMS_PER_SM x SMs up, one 128-key program per (sequence, kv head) streams at the copy
    # ceiling; from MID_MIN_PROGRAMS up, 64-key programs split so that ~MID_PROGRAMS_PER_SM x SMs programs run
    # beat it by 3-8%; below that, the few-sequence case, 64-key splits fill the GPU.
    DIRECT_PROGRAMS_PER_SM = 12
    MID_PROGRAMS_PER_SM = 32
    MID_MIN_PROGRAMS = 128
    # An e4m3 cache from MID_MIN_PROGRAMS up: one-warp programs of 16 keys take 9-25% less time than both regimes'
    # 4-warp tiles at 16-256 sequences (softmax and P stay in registers: a shorter chain per tile). Split to one
    # wave (16 an SM at 128 registers); where one split already fills half a wave or more, to ~4 waves (two
    # waves' tail over uneven contexts cost 7% at 256 sequences).
    ONE_WARP_TILES = (16, 1, 2, 128)
    ONE_WARP_WAVE_PER_SM = 16
    ONE_WARP_WAVES = 4

    name = "triton"

    def __init__(
        self,
        max_splits: int = 32,
        min_split_tokens: int = 256,
        programs_per_sm: int = 4,
        decode_tiles: tuple[int, ...] | None = None,
        decode_heads_first: bool = True,
        prefill_tiles: tuple[int, int, int, int] | None = None,
    ) -> None:
        self.max_splits = max_splits  # bounds the grid and the partial-result buffers
        self.min_split_tokens = min_split_tokens  # shorter splits cost more in merging than they win
        self.programs_per_sm = programs_per_sm
        # Decode tiling (keys per tile, warps, pipeline stages[, register cap]); None = the default below. The
        # tiles pick the kernel's layout (split_decode); benchmarks/attention_kernels.py --sweep-decode measures them.
        self.decode_tiles = decode_tiles
        # Grid order (kv heads, splits, batch): the programs of one sequence's kv heads run side by side and
        # read the interleaved head slices of the same cache pages together (W1 0.6B +2-4% on an H200).
        self.decode_heads_first = decode_heads_first
        # Prefill tiling (queries per tile, keys per tile, warps, stages); None = cuda_prefill_tiles on a GPU
        # (benchmarks/attention_kernels.py --sweep-prefill measures the alternatives), 16 x 16 in the interpreter.
        self.prefill_tiles = prefill_tiles

    # -- store ---------------------------------------------------------------------------------------------------------

    store_kvcache = staticmethod(store_kvcache)

    # -- prefill -------------------------------------------------------------------------------------------------------

    def prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """Causal attention of each prefill chunk over its cached prefix and itself; ``out`` may be preallocated."""
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
        if out is None:
            out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
        if num_tokens == 0 or meta.num_prefills == 0:
            return out
        if meta.max_seqlen_q <= 0:
            raise ValueError("meta.max_seqlen_q must be set (host int) for the Triton prefill grid")
        v_keys = check_cache(k_cache, v_cache)
        assert num_heads % num_kv_heads == 0 and q.stride(-1) == 1 and out.stride(-1) == 1
        bt = meta.prefill_block_tables
        assert bt.stride(-1) == 1

        block_d = max(16, triton.next_power_of_2(head_dim))
        pdl = use_pdl(q)
        default = self.cuda_prefill_tiles(head_dim) if q.is_cuda else (16, 16, 1, 1)
        block_m, block_n, num_warps, num_stages = self.prefill_tiles or default
        # max_seqlen_q is a host int: no device sync; programs past a sequence's length exit at once.
        grid = (triton.cdiv(meta.max_seqlen_q, block_m), num_heads, meta.num_prefills)
        _prefill_kernel[grid](
            q,
            k_cache,
            v_cache,
            out,
            meta.cu_seqlens_q,
            meta.prefill_seq_lens,
            bt,
            *kernel_scales(k_cache, scale, k_scale, v_scale),
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            *page_strides(k_cache, v_cache),
            bt.stride(0),
            GROUP=num_heads // num_kv_heads,
            PAGE=page,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            DOT_F16=dot_dtype_f16(q, k_cache),
            V_KEYS=v_keys,
            USE_PDL=pdl,
            num_warps=num_warps,
            num_stages=num_stages,
            launch_pdl=pdl,
        )
        return out

    @staticmethod
    def cuda_prefill_tiles(head_dim: int) -> tuple[int, int, int, int]:
        """The prefill tiles on a GPU unless ``prefill_tiles`` says otherwise: head_dim <= 128 takes 64 x 64 tiles, 4
        warps, 1.24-1.27x faster than 128 x 64 with 8 warps on W1-like prompts of 100-1,024 tokens (H200); wider
        heads smaller tiles (registers)."""
        return (64, 64, 4, 2) if head_dim <= 128 else (64, 32, 4, 2)

    # -- decode --------------------------------------------------------------------------------------------------------

    def num_decode_splits(
        self,
        batch: int,
        num_kv_heads: int,
        max_seq_len: int,
        device: torch.device,
        fp8_cache: bool = False,
        sms: int | None = None,
    ) -> int:
        """Host-only split policy: enough programs to fill the GPU, but splits of >= min_split_tokens. ``sms``: the
        GPU's SM count (None: ``device``'s; a build check on the CPU names an H100's)."""
        programs, sms = max(1, batch * num_kv_heads), sms or num_sms(device, cpu=4)
        if fp8_cache and programs >= self.MID_MIN_PROGRAMS:  # the one-warp regime's target
            wave = self.ONE_WARP_WAVE_PER_SM * sms
            waves = wave // programs if wave // programs > 1 else self.ONE_WARP_WAVES * wave // programs
            want = 1 << max(0, waves.bit_length() - 1)
        elif programs >= self.DIRECT_PROGRAMS_PER_SM * sms:
            return 1
        elif programs >= self.MID_MIN_PROGRAMS:  # the largest power of two within the mid regime's target
            want = 1 << max(1, (self.MID_PROGRAMS_PER_SM * sms // programs).bit_length() - 1)
        else:
            want = triton.cdiv(sms * self.programs_per_sm, programs)
        if max_seq_len > 0:  # 0 = unknown: do not cap by length
            want = min(want, triton.cdiv(max_seq_len, self.min_split_tokens))
        return max(1, min(want, self.max_splits))

    def warmup(self, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, dtype: torch.dtype) -> None:
        """Compile every decode variant a run can meet (single split, each merge width up to max_splits, the
        tiles of the few-sequence, the mid and the one-warp regime) at start-up, so no timed step stalls on the
        compiler."""
        head_dim, device, num_kv_heads = k_cache.shape[3], k_cache.device, k_cache.shape[2]
        batches = {2, triton.cdiv(self.MID_MIN_PROGRAMS, num_kv_heads)}
        if k_cache.is_cuda and k_cache.element_size() == 1:  # one-warp tiles take unsplit programs from a wave up
            batches.add(triton.cdiv(self.ONE_WARP_WAVE_PER_SM * num_sms(device, cpu=4), num_kv_heads))
        for batch in sorted(batches):
            q = torch.zeros(batch, num_heads, head_dim, dtype=dtype, device=device)
            meta = AttentionMetadata(
                slot_mapping=torch.zeros(0, dtype=torch.int64, device=device),
                num_prefill_tokens=0,
                num_prefills=0,
                num_decodes=batch,
                decode_seq_lens=torch.ones(batch, dtype=torch.int32, device=device),
                decode_block_tables=torch.zeros(batch, 3, dtype=torch.int32, device=device),
            )
            splits = 1
            while True:
                self.decode(q, k_cache, v_cache, meta, 1.0, num_splits=splits)
                if splits >= self.max_splits:
                    break
                splits = min(2 * splits, self.max_splits)

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
        num_splits: int | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """One query per row of ``q``; rows with seq_len 0 (batch padding) get zeros.

        ``num_splits`` overrides the split policy (e.g. to pin it while capturing CUDA graphs).
        """
        batch, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        if out is None:
            out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
        if batch == 0:
            return out
        assert num_heads % num_kv_heads == 0 and q.stride(-1) == 1 and out.stride(-1) == 1
        bt = meta.decode_block_tables
        assert bt.stride(-1) == 1
        one_warp = q.is_cuda and head_dim <= 128 and k_cache.element_size() == 1 and not self.decode_tiles
        if num_splits is None:
            num_splits = self.num_decode_splits(batch, num_kv_heads, meta.max_decode_seq_len, q.device, one_warp)

        if q.is_cuda:
            sms = num_sms(q.device, cpu=4)
            tiles = self.cuda_decode_tiles(batch, num_kv_heads, num_splits, head_dim, k_cache.element_size(), sms)
        else:  # the interpreter: one-warp tiles, as the e4m3 regime's (their warps only pick the layout here)
            tiles = self.decode_tiles or (16, 1, 1)
        scales = (scale, k_scale, v_scale)
        split_decode(
            q, k_cache, v_cache, meta.decode_seq_lens, bt, out, scales, num_splits, tiles, self.decode_heads_first
        )
        return out

    def cuda_decode_tiles(
        self, batch: int, num_kv_heads: int, num_splits: int, head_dim: int, cache_bytes: int, sms: int
    ) -> tuple[int, ...]:
        """The decode tiles on a GPU of ``sms`` SMs (``decode_tiles`` unless None), for a cache of ``cache_bytes`` a
        value. 128-key tiles: 3-4% faster than 64 at batch 256 on an H200; two stages of K and V tiles then take
        128 KB of shared memory at head_dim 128 in 16-bit types (64 keys in fp32). Split programs take 64 keys: the
        best tiling of the mid regime in the H200 sweeps (see num_decode_splits), and at 1-4 sequences of 200-600
        tokens 0.9-3.4 us faster than 128 (split + merge; W2 -1.3%, log 26d)."""
        if self.decode_tiles:
            return self.decode_tiles
        narrow = head_dim <= 128
        wide = narrow and cache_bytes <= 2 and num_splits == 1
        programs, wave = batch * num_kv_heads, self.ONE_WARP_WAVE_PER_SM * sms
        if narrow and cache_bytes == 1 and programs >= self.MID_MIN_PROGRAMS and 2 * programs * num_splits >= wave:
            return self.ONE_WARP_TILES  # an e4m3 cache from half a wave up
        return (128 if wide else (64 if narrow else 32), 4, 2)
