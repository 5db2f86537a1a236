"""Where a decode step's time goes inside one worker (no coordinator, no ZMQ): times ModelRunner.execute for
single-sequence and batched decode, then prints the profiler's top CPU and CUDA ops.

    python -m benchmarks.profile_step --shape qwen3-0.6b [--batch 1 256] [--context 128] [--enforce-eager]
    torchrun --nproc-per-node 2 -m benchmarks.profile_step --shape qwen3-8b    # a TP=2 step (rank 0 prints)

--context sets the prompt length each sequence has before the timed decode steps (W1's contexts average ~1,100).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

from benchmarks.profile_summary import gap_summary, kernel_summary
from protocol.messages import StepCommand, WorkerConfig
from protocol.sampling_params import SamplingParams


def i32(x):
    return np.asarray(x, dtype=np.int32)


def step(step_id, slots, tokens_per_seq, tokens, new_blocks, new=None):
    new = new or {}
    num_new = len(new.get("slots", []))
    lens = list(tokens_per_seq)
    num_prefills = sum(n > 1 for n in lens)  # callers list multi-token rows first
    return StepCommand(
        step_id=step_id,
        slots=i32(slots),
        prefill_num_tokens=i32(lens[:num_prefills]),
        token_ids=i32(tokens),
        new_block_counts=i32([len(b) for b in new_blocks]),
        new_block_ids=i32([x for b in new_blocks for x in b]),
        skip_sample_rows=i32([]),
        new_slots=i32(new.get("slots", [])),
        new_start_pos=i32([0] * num_new),
        new_params=[SamplingParams(temperature=new.get("temperature", 0.0)) for _ in range(num_new)],
        new_num_outputs=i32([0] * num_new),
        new_prompt_lens=i32([0] * num_new),
        new_past_token_ids=i32([]),
        freed_slots=i32([]),
    )


def host_profile(runner, slots, prompt: int, blocks, temperature: float, decode_slots=()) -> None:
    """How long launching one prefill step takes on the host (the device idle beforehand), against the step's
    device time; then a cProfile of one launch: where the host time goes. ``decode_slots`` (sequences already
    holding ``prompt`` tokens) add one decode row each, as in W1's mixed steps."""
    import cProfile
    import pstats

    decode_slots = list(decode_slots)

    def prefill(sid: int):
        runner.num_computed[slots] = 0
        runner.num_computed[decode_slots] = prompt
        lens = [prompt] * len(slots) + [1] * len(decode_slots)
        tokens = [1] * (prompt * len(slots)) + [-1] * len(decode_slots)
        new_blocks = list(blocks) + [[] for _ in decode_slots]
        return step(sid, list(slots) + decode_slots, lens, tokens, new_blocks, {"slots": slots})

    for sid in range(3):
        cmd = prefill(100 + sid)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pending = runner.launch(cmd)
        t1 = time.perf_counter()
        pending.wait()
        t2 = time.perf_counter()
        print(
            f"prefill {len(slots)} x {prompt} + {len(decode_slots)} decode rows: launch {1e3 * (t1 - t0):.2f} ms,"
            f" to tokens {1e3 * (t2 - t0):.2f} ms"
        )
    cmd = prefill(200)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    pending = runner.launch(cmd)
    prof.disable()
    pending.wait()
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)


def prefill_prompts(runner, slots: list[int], prompt: int, blocks: list[list[int]], temperature: float = 0.0) -> None:
    """Prompts of ``prompt`` tokens for new sequences in ``slots`` (on ``blocks``), in steps within the token budget."""
    per_step = max(1, 8192 // prompt)
    for lo in range(0, len(slots), per_step):
        hi = min(len(slots), lo + per_step)
        new = {"slots": slots[lo:hi], "temperature": temperature}
        runner.execute(step(0, slots[lo:hi], [prompt] * (hi - lo), [1] * (prompt * (hi - lo)), blocks[lo:hi], new))


def decode_step(step_id: int, slots: list[int]) -> StepCommand:
    """One decode token for each of ``slots`` (its sampled token fed back)."""
    return step(step_id, slots, [1] * len(slots), [-1] * len(slots), [[] for _ in slots])


def pipelined_decode(runner, slots: list[int], n: int, sid: int) -> int:
    """``n`` decode steps of ``slots`` as the worker loop runs them (launch N+1 before waiting on N), the first
    numbered ``sid``; returns the next step id."""
    prev = None
    for _ in range(n):
        cur = runner.launch(decode_step(sid, slots))
        sid += 1
        if prev is not None:
            prev.wait()
        prev = cur
    prev.wait()
    return sid


def make_runner(shape: str, max_bs: int, num_blocks: int, quantization, kv_cache_dtype: str, enforce_eager: bool):
    """A worker's ModelRunner in this process for ``shape`` (random weights), its KV pool of ``num_blocks``, kernels
    warmed up and CUDA graphs captured; under torchrun one per rank, rank 0 the one that prints."""
    from benchmarks.gpu import require_cuda
    from benchmarks.shapes import load_config, write_shape

    require_cuda(int(os.environ.get("WORLD_SIZE", 1)))
    import torch.distributed as dist

    from comm.custom_all_reduce import init_custom_all_reduce
    from comm.parallel import set_tp

    # under torchrun every rank runs the same steps, as the workers of one TP group do
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    init = "env://" if world > 1 else "tcp://127.0.0.1:29555"
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
    torch.cuda.set_device(rank)
    set_tp(rank, world)
    model_dir = write_shape(shape) if rank == 0 else None
    dist.barrier()
    model_dir = write_shape(shape)  # written by rank 0; the others only find it
    if world > 1:
        hidden = load_config(model_dir)["hidden_size"]
        init_custom_all_reduce(8192 * hidden * 2, torch.bfloat16, torch.device("cuda", rank))
    if rank:
        sys.stdout = open(os.devnull, "w")  # rank 0 reports
    from worker import startup
    from worker.model_runner import ModelRunner

    cfg = WorkerConfig(
        model=str(model_dir),
        device="cuda",
        dtype="auto",
        load_format="dummy",
        block_size=16,
        max_num_seqs=max_bs,
        max_num_batched_tokens=8192,
        max_model_len=4096,
        num_kv_blocks=num_blocks,
        gpu_memory_utilization=0.9,
        kv_cache_memory_bytes=0,
        enforce_eager=enforce_eager,
        seed=0,
        attention_backend="auto",
        dist_init_method="",
        quantization=quantization or "",
        kv_cache_dtype=kv_cache_dtype,
    )
    runner = ModelRunner(cfg, torch.device("cuda", rank))
    runner.allocate_kv(num_blocks)
    startup.warmup_kernels(runner)
    startup.capture_graphs(runner)
    return runner


def main() -> None:
    from benchmarks.shapes import SHAPES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--shape", default="qwen3-0.6b", choices=list(SHAPES), help="model shape (random weights)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 256], help="decode batch sizes to time")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0 = greedy)")
    p.add_argument("--context", type=int, default=128, help="prompt tokens per sequence before the timed steps")
    p.add_argument("--prefill", action="store_true", help="also print the kernel ledger of the prefill steps")
    p.add_argument("--quantization", choices=["fp8"], help="FP8 linear layers (quantized at load)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="fp8: an e4m3 KV cache")
    p.add_argument(
        "--host-profile",
        action="store_true",
        help="time the host launch of a prefill step (plus a decode row per other sequence) and cProfile it",
    )
    a = p.parse_args()
    max_bs = max(a.batch)
    blocks_per_seq = (a.context + 512) // 16 + 1  # room for the prompt and every timed step
    runner = make_runner(a.shape, max_bs, max_bs * blocks_per_seq, a.quantization, a.kv_cache_dtype, a.enforce_eager)
    rows = []
    for bs in a.batch:
        slots = list(range(bs))
        blocks = [[s * blocks_per_seq + j for j in range(blocks_per_seq)] for s in slots]
        prompt = a.context
        per_step = max(1, 8192 // prompt)  # prefill in steps within the token budget
        # with --prefill the prompts are prefilled twice and the second (compiled) pass is profiled
        for rep in range(2 if a.prefill else 1):
            profiled = rep == 1
            # eager (--enforce-eager): the CPU ops too, by input shape, to name what launched each kernel
            activities = [torch.profiler.ProfilerActivity.CUDA]
            if a.enforce_eager:
                activities.append(torch.profiler.ProfilerActivity.CPU)
            prefill_prof = torch.profiler.profile(activities=activities, record_shapes=a.enforce_eager)
            if profiled:
                torch.cuda.synchronize()
                prefill_prof.start()
                t0 = time.perf_counter()
            prefill_prompts(runner, slots, prompt, blocks, a.temperature)
            if profiled:
                torch.cuda.synchronize()
                elapsed = time.perf_counter() - t0
                prefill_prof.stop()
                num_steps = -(-bs // per_step)
                print(
                    f"\n--- batch {bs}: {num_steps} prefill steps of {per_step} x {prompt} tokens, "
                    f"{elapsed / num_steps * 1e3:.2f} ms/step (profiled)"
                )
                kernel_summary(prefill_prof, num_steps)
                if a.enforce_eager:
                    ops = prefill_prof.key_averages(group_by_input_shape=True)
                    print(ops.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=40))
        if a.host_profile:
            host_profile(runner, slots[:per_step], prompt, blocks[:per_step], a.temperature, slots[per_step:])

        # each phase starts from the same contexts (KV rewritten in place), so their times compare
        def rewind(slots=slots, prompt=prompt):
            torch.cuda.synchronize()
            runner.num_computed[slots] = prompt

        times, sid = [], 1
        for _ in range(100):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            runner.execute(decode_step(sid, slots))
            times.append(time.perf_counter() - t0)
            sid += 1

        rewind()
        t0 = time.perf_counter()
        sid = pipelined_decode(runner, slots, 100, sid)
        pipelined = (time.perf_counter() - t0) / 100
        rewind()
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            sid = pipelined_decode(runner, slots, 20, sid)
        print(f"\n--- batch {bs}: top ops by self CPU time (20 steps)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50))
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=16, max_name_column_width=60))
        kernel_summary(prof, 20)
        gap_summary(prof, 20)
        graph_ms = float("nan")
        if runner.graphs is not None:  # the forward alone, back to back: the device-bound part of a step
            graph = runner.graphs.graphs[min(b for b in runner.graphs.buckets if b >= bs)]
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(50):
                graph.replay()
            stop.record()
            torch.cuda.synchronize()
            graph_ms = start.elapsed_time(stop) / 50
        rows.append((bs, statistics.median(times) * 1e3, pipelined * 1e3, graph_ms))
        runner.num_computed[:] = 0
    print(f"{'batch':>6s} {'execute ms (median)':>20s} {'pipelined ms/step':>18s} {'graph replay ms':>16s}")
    for bs, ms, pl, gm in rows:
        print(f"{bs:6d} {ms:20.3f} {pl:18.3f} {gm:16.3f}")


if __name__ == "__main__":
    main()
