"""What does W3 with prefix caching cost the host? (CPU; no GPU, no worker process) For bisecting host-side time.

The real ``LLM.generate`` runs W3's exact requests (256 x (2,048 shared + 64 unique ids), 128 outputs, temperature
0.6, ignore_eos) through the real coordinator against an in-process stand-in for the worker group: each StepCommand
goes through the real codec, and the real CPU ``ModelRunner`` (2 layers, 64 wide, Qwen3's vocabulary) applies
slot updates, lays the step out and builds attention and sampling state; only the forward, LM head and sampler are
stubbed (random tokens). Prints each phase's time (ms over the whole generate, medians of --repeat fresh-engine
runs), the last line JSON. ``cp.*`` rows: host time a GPU run's device waits for (before the first send, between
the three prefill sends, after the last result); ``--clock cpu`` counts this thread's CPU time only.

    python -m benchmarks.w3_host [--repeat 5] [--clock wall|cpu] [--num-prompts 256] [--no-worker]

It runs unchanged on older trees (version switches below): copy it into another commit's tree and run it there,
e.g. ``git archive c6ee00b | tar -x -C /tmp/base && cp benchmarks/w3_host.py /tmp/base/benchmarks/``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

# ---- version switches (APIs that moved between c6ee00b and today) --------------------------------------------


def _import_first(*names: str):
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(f"none of {names}")


CLOCK = time.perf_counter  # --clock cpu: this thread's CPU time (a loaded machine's waits left out)
TIMES: dict[str, float] = defaultdict(float)
COUNTS: dict[str, int] = defaultdict(int)
SENDS: list[tuple[float, float]] = []  # per step sent: when the coordinator handed it over, when the worker was done


def _timed(owner, name: str, label: str) -> None:
    """Wrap ``owner.name`` (an instance's method; its class's for a slotted instance, once) so that its calls add
    to TIMES[label]."""
    fn = getattr(owner, name)
    if getattr(fn, "w3_timed", False):
        return

    def wrapper(*a, **k):
        t0 = CLOCK()
        try:
            return fn(*a, **k)
        finally:
            TIMES[label] += CLOCK() - t0
            COUNTS[label] += 1

    wrapper.w3_timed = True
    try:
        setattr(owner, name, wrapper)
    except AttributeError:  # a slots dataclass: the class's function, wrapped once for every instance
        cls_fn = getattr(type(owner), name)

        def method(self, *a, **k):
            t0 = CLOCK()
            try:
                return cls_fn(self, *a, **k)
            finally:
                TIMES[label] += CLOCK() - t0
                COUNTS[label] += 1

        method.w3_timed = True
        setattr(type(owner), name, method)


def _shape_dir() -> Path:
    """Qwen3-0.6B's vocabulary, special ids and limits on a 2-layer, 64-wide body: the coordinator sees W3's model,
    the CPU runner stays cheap (the forward is stubbed anyway)."""
    out = Path(tempfile.gettempdir()) / "nanoserve_w3_host_shape"
    shapes = importlib.import_module("benchmarks.shapes")
    cfg = dict(shapes.SHAPES["qwen3-0.6b"])
    cfg.update(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_window_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        dtype="float32",
    )
    if (out / "config.json").is_file() and json.loads((out / "config.json").read_text()) == cfg:
        return out
    out.mkdir(parents=True, exist_ok=True)
    shapes.build_stand_in_tokenizer(cfg["vocab_size"]).save_pretrained(out)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


class FakeWorkers:
    """The WorkerGroup surface the engine uses, in this process: real codec both ways, the real ModelRunner's host
    side (``with_worker``), random tokens."""

    with_worker = True
    num_blocks = 38_000  # an H100's pool for Qwen3-0.6B at the default memory utilization, about

    def __init__(self, worker_cfg, world_size: int = 1, **_kw) -> None:
        import numpy as np
        import torch

        self.codec = importlib.import_module("protocol.codec")
        messages = importlib.import_module("protocol.messages")
        self.StepResult, self.StepCommand = messages.StepResult, messages.StepCommand
        self.np, self.torch = np, torch
        self.rng = np.random.default_rng(0)
        self.num_kv_blocks = self.num_blocks
        self.kv_block_bytes = 1 << 20
        self.device_name = "stand-in"
        self.procs: list = []
        self.results: dict[int, bytes] = {}
        self.runner = self._runner(worker_cfg) if self.with_worker else None

    def adopt(self, *a, **k):  # today's Engine(cfg, workers=...) form
        return self

    def allocate(self, eos_token_ids) -> None:  # the engine's second start-up call, since protocol 12
        return None

    def _runner(self, worker_cfg):
        import dataclasses

        torch = self.torch
        mr = importlib.import_module("worker.model_runner")
        cfg = dataclasses.replace(worker_cfg, device="cpu", dtype="float32", load_format="dummy")
        runner = mr.ModelRunner(cfg, torch.device("cpu"))
        runner.allocate_kv(self.num_blocks)
        hidden = runner.model_config.hidden_size
        rng = torch.Generator().manual_seed(0)

        def run_model(input_ids, positions, meta):  # the forward stubbed: attention metadata was built already
            return torch.zeros(len(input_ids), hidden)

        def compute_logits(rows):
            return torch.zeros(len(rows), 1)

        def sample(logits, st, generator, noise_seed):
            return torch.randint(0, 10000, (logits.shape[0],), generator=rng)

        runner.run_model = run_model
        runner.model.compute_logits = compute_logits
        for name in ("worker.step_sampling", "worker.model_runner"):  # where ``sample`` is looked up, by version
            try:
                mod = importlib.import_module(name)
            except ImportError:
                continue
            if hasattr(mod, "sample"):
                mod.sample = sample
        for name, label in (
            ("apply_slot_updates", "w.slot_updates"),
            ("prepare_host", "w.prepare_host"),
            ("device_meta", "w.device_meta"),
            ("launch", "w.launch (all)"),
        ):
            _timed(runner, name, label)
        _timed(runner.sampling, "tensors", "w.sampling_tensors")
        _timed(runner.sampling, "start", "w.sampling_start")
        return runner

    def send_step(self, step) -> None:
        t0 = CLOCK()
        data = self.codec.encode(step)
        sent = CLOCK()  # the coordinator's part ends here, the worker's begins
        TIMES["c.encode_step"] += sent - t0
        TIMES["step_bytes"] += len(data)
        cmd = self.codec.decode(data)
        t1 = CLOCK()
        TIMES["w.decode_step"] += t1 - sent
        if self.runner is not None:
            tokens = self.runner.launch(cmd).wait()
        else:
            n = len(cmd.slots) - len(cmd.skip_sample_rows)
            tokens = self.rng.integers(0, 10000, n).astype(self.np.int32)
        t2 = CLOCK()
        self.results[cmd.step_id] = self.codec.encode(self.StepResult(cmd.step_id, 0, tokens))
        end = CLOCK()
        TIMES["w.encode_result"] += end - t2
        SENDS.append((sent, end))

    def recv_result(self, step_id: int):
        t0 = CLOCK()
        res = self.codec.decode(self.results.pop(step_id))
        TIMES["c.decode_result"] += CLOCK() - t0
        return res

    def run_step(self, step):
        self.send_step(step)
        return self.recv_result(step.step_id)

    def send_masks(self, masks) -> None:
        raise AssertionError("W3 has no structured outputs")

    def check_alive(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def run_once(model_dir: Path, num_prompts: int, with_worker: bool) -> dict:
    import gc

    engine_mod = importlib.import_module("coordinator.engine")
    llm_mod = _import_first("nanoserve.llm", "client.llm")
    import torch

    from benchmarks.workloads import w3_requests
    from protocol.sampling_params import SamplingParams

    torch.set_num_threads(1)  # one thread: thread CPU time counts all of it, runs compare on a shared machine
    FakeWorkers.with_worker = with_worker
    engine_mod.WorkerGroup = FakeWorkers
    llm = llm_mod.LLM(
        str(model_dir),
        device="cpu",
        dtype="float32",
        load_format="dummy",
        max_model_len=4096,
        enable_prefix_caching=True,
        enforce_eager=True,
    )
    eng = llm.engine
    # warm-up as the benchmark does (a small generate), then the timed one
    llm.generate([1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=16), use_tqdm=False)
    _timed(eng, "add_request", "c.add_request")
    _timed(eng.scheduler, "schedule", "c.schedule")
    _timed(eng, "apply_result" if hasattr(eng, "apply_result") else "_apply", "c.apply_result")
    _timed(eng.block_manager, "match_prefix", "c.match_prefix")
    _timed(eng.output_processor, "update", "c.output_update")
    TIMES.clear()
    COUNTS.clear()
    SENDS.clear()
    reqs = w3_requests(1, num_prompts, prefix_cached=True)
    prompts = [r.prompt for r in reqs]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=r.max_tokens) for r in reqs]
    t0 = CLOCK()
    outs = llm.generate(prompts, params, use_tqdm=False)
    total = (t_end := CLOCK()) - t0
    assert all(len(o.outputs[0].token_ids) == r.max_tokens for o, r in zip(outs, reqs))
    res = {k: v * 1e3 for k, v in TIMES.items() if k != "step_bytes"}
    res["total"] = total * 1e3
    # the host time on a GPU run's critical path: before the first step reaches the device (admission and the first
    # schedule, then the worker's layout of it), the coordinator between the prefill steps' sends (128 admissions
    # a step: slower than the device's step?), and after the last step's result (finishing 256 requests)
    ms = lambda x: x * 1e3  # noqa: E731
    res["cp.until_first_send"] = ms(SENDS[0][0] - t0)
    res["cp.worker_first_step"] = ms(SENDS[0][1] - SENDS[0][0])
    for k in (1, 2, 3):
        res[f"cp.coordinator_before_step{k}"] = ms(SENDS[k][0] - SENDS[k - 1][1])
        res[f"w.step{k}"] = ms(SENDS[k][1] - SENDS[k][0])
    res["c.decode_gap_median"] = ms(statistics.median(b[0] - a[1] for a, b in zip(SENDS[4:], SENDS[5:])))
    res["w.decode_step_median"] = ms(statistics.median(e - s for s, e in SENDS[4:]))
    res["cp.after_last_step"] = ms(t_end - SENDS[-1][1])
    worker = sum(v for k, v in res.items() if k in ("w.decode_step", "w.launch (all)", "w.encode_result"))
    res["coordinator (total - worker)"] = res["total"] - worker
    res["steps"] = eng.stats()["steps"]
    res["prefix_cache_hit_tokens"] = eng.stats()["prefix_cache_hit_tokens"]
    res["step_kbytes"] = TIMES["step_bytes"] / 1e3
    llm.close()
    del llm, eng
    gc.collect()
    return res


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--repeat", type=int, default=5, help="runs, each in a fresh engine; medians reported")
    p.add_argument("--num-prompts", type=int, default=256, help="W3 requests (the first N of the 256)")
    p.add_argument("--no-worker", action="store_true", help="coordinator only (no ModelRunner host side)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: thread CPU time (loaded machines)")
    args = p.parse_args(argv)
    global CLOCK
    CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter
    model_dir = _shape_dir()
    runs = [run_once(model_dir, args.num_prompts, not args.no_worker) for _ in range(args.repeat)]
    keys = list(runs[0])
    med = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in keys}
    for k in keys:
        vals = " ".join(f"{r.get(k, 0.0):9.1f}" for r in runs)
        print(f"{k:30s} median {med[k]:9.1f}   runs {vals}")
    print(json.dumps({"median": med, "runs": runs}))
    return med


if __name__ == "__main__":
    sys.path.insert(0, str(Path.cwd()))
    main()
