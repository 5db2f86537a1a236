"""Probe: does a decode step run faster as two half-batch forwards on two streams (one CUDA graph) than as one?

Attention streams K/V (memory-bound) while the GEMMs and short kernels are latency- or compute-bound; two halves
on two streams let one half's GEMMs run beside the other half's attention.

    python benchmarks/overlap_probe.py --shape qwen3-0.6b --batch 64 128 256 --context 1024
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from kernels.attention import AttentionMetadata  # noqa: E402
from model.context import forward_context  # noqa: E402
from protocol.messages import WorkerConfig  # noqa: E402

# (priority of half A's stream, of half B's, whether B starts only when A's first attention starts); lower = higher
VARIANTS = [(0, 0, False), (0, 0, True), (-1, 0, True), (0, -1, True)]


def main() -> None:
    from profile_step import step
    from shapes import write_shape
    from timing import replay_ms

    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--batch", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--context", type=int, default=1024)
    a = p.parse_args()
    import torch.distributed as dist

    from model.parallel import set_tp

    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29556", rank=0, world_size=1)
    torch.cuda.set_device(0)
    set_tp(0, 1)
    from worker import startup
    from worker.model_runner import ModelRunner

    max_bs = max(a.batch)
    blocks_per_seq = (a.context + 64) // 16 + 1
    num_blocks = max_bs * blocks_per_seq
    cfg = WorkerConfig(
        str(write_shape(a.shape)), "cuda", "auto", "dummy", 16, max_bs, 8192, 4096, num_blocks, 0.9, 0, False, 0,
        "auto", "", [],
    )  # fmt: skip
    runner = ModelRunner(cfg, torch.device("cuda", 0))
    runner.allocate_kv(num_blocks)
    startup.warmup_kernels(runner)
    startup.capture_graphs(runner)
    g = runner.graphs
    model, backend = runner.model, runner.backend
    rows = []
    for bs in a.batch:
        slots = list(range(bs))
        blocks = [[s * blocks_per_seq + j for j in range(blocks_per_seq)] for s in slots]
        per_step = max(1, 8192 // a.context)
        for lo in range(0, bs, per_step):
            hi = min(bs, lo + per_step)
            runner.execute(
                step(0, slots[lo:hi], [a.context] * (hi - lo), [1] * (a.context * (hi - lo)), blocks[lo:hi],
                     {"slots": slots[lo:hi]})
            )  # fmt: skip
        runner.execute(step(1, slots, [1] * bs, [-1] * bs, [[] for _ in slots]))  # fills the static buffers
        torch.cuda.synchronize()

        def meta(lo: int, hi: int) -> AttentionMetadata:
            return AttentionMetadata(
                slot_mapping=g.slot_mapping[lo:hi], num_prefill_tokens=0, num_prefills=0, num_decodes=hi - lo,
                decode_seq_lens=g.seq_lens[lo:hi], decode_block_tables=g.block_tables[lo:hi],
                max_decode_seq_len=cfg.max_model_len,
            )  # fmt: skip

        h = bs // 2
        halves = [(0, h), (h, bs)]

        def fwd(lo: int, hi: int) -> torch.Tensor:
            with forward_context(meta(lo, hi), backend):
                return model(g.input_ids[lo:hi], g.positions[lo:hi])

        def capture(prio_a: int, prio_b: int, offset: bool, halves=halves) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
            main, side = torch.cuda.Stream(priority=prio_a), torch.cuda.Stream(priority=prio_b)
            for _ in range(2):  # compile / allocate workspaces on both streams outside the capture
                with torch.cuda.stream(main):
                    fwd(*halves[0])
                with torch.cuda.stream(side):
                    fwd(*halves[1])
                torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            hooks, started = [], torch.cuda.Event()
            with torch.cuda.graph(graph, stream=main):
                if offset:  # half B starts when half A's first attention starts
                    attn0 = model.model.layers[0].self_attn.attn
                    hooks.append(attn0.register_forward_pre_hook(lambda *_: started.record(main)))
                out_a = fwd(*halves[0])
                for hk in hooks:
                    hk.remove()
                side.wait_stream(main) if not offset else side.wait_event(started)
                with torch.cuda.stream(side):
                    out_b = fwd(*halves[1])
                main.wait_stream(side)
                out = torch.cat([out_a, out_b])
            return graph, out

        full_ms = replay_ms(g.graphs[bs])
        g.graphs[bs].replay()
        ref = g.outputs[bs][:bs].float().clone()
        row = [bs, full_ms]
        for prio_a, prio_b, offset in VARIANTS:
            graph, out = capture(prio_a, prio_b, offset)
            ms = replay_ms(graph)
            graph.replay()
            torch.cuda.synchronize()
            err = (out.float() - ref).abs().max().item()
            row.append(ms)
            print(f"batch {bs} prio {prio_a}/{prio_b} offset {offset}: {ms:.3f} ms (one {full_ms:.3f}) err {err:.2g}")
        rows.append(row)
        runner.num_computed[:] = 0
    print(f"\n{a.shape}, context {a.context}: ms per forward (graph replay)")
    print(
        f"{'batch':>6s} {'one':>8s} " + " ".join(f"{f'{pa}/{pb}' + ('o' if o else ''):>8s}" for pa, pb, o in VARIANTS)
    )
    for r in rows:
        print(f"{r[0]:6d} " + " ".join(f"{x:8.3f}" for x in r[1:]))


if __name__ == "__main__":
    main()
