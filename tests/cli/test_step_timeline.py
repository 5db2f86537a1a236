"""benchmarks/step_timeline.py's ledger: each kernel charged only the time it adds to the critical path."""

from benchmarks.step_timeline import critical_path


def test_overlapping_kernels_are_charged_their_share_and_gaps_the_kernel_after():
    spans = [
        (0.0, 10.0, "_rmsnorm_kernel"),
        (2.0, 30.0, "_fp8_gemv_kernel"),  # overlaps the norm: charged 20 of its 28
        (25.0, 28.0, "_qk_norm_rope_kernel"),  # inside the GEMV: charged nothing
        (40.0, 45.0, "_decode_split_kernel"),  # 10 idle before it
    ]
    rows, window = critical_path(spans)
    assert window == 45.0
    gemv = rows["_fp8_gemv_kernel [_rmsnorm_kernel -> _qk_norm_rope_kernel]"]
    assert gemv[:2] == [20.0, 0.0] and gemv[2] == 28.0
    assert rows["_qk_norm_rope_kernel"][:2] == [0.0, 0.0]
    assert rows["_decode_split_kernel"][:2] == [5.0, 10.0]
    assert sum(r[0] + r[1] for r in rows.values()) == window
