"""The Hugging Face transformers peer: continuous batching (``ContinuousBatchingManager``) on the same workload.

Used by ``benchmarks/throughput.py --compare hf``; usable alone::

    with HFPeer(model_dir, device="cuda", dtype="bfloat16", temperature=0.6, max_prompt_len=1024,
                max_new_tokens=1024, num_requests=64) as peer:
        seconds, output_tokens = peer.run(prompts, max_new_tokens_per_request)

The model is built from the same config.json with random weights (``AutoModelForCausalLM.from_config``, sdpa
attention, created directly on the device). One manager serves every timed batch of a workload: entering it runs
HF's own warm-up (CUDA-graph capture at its largest sizes), then ``run`` is called once untimed on a small batch
(``warmup``) before the timed batches. Requests go in through ``manager.add_request(input_ids, max_new_tokens=...)``,
so every request gets its own max_new_tokens, exactly like nanoserve's per-request ``max_tokens`` (``generate_batch``
only takes one max_new_tokens for all). EOS is disabled (``eos_token_id=-1``), the analogue of ``ignore_eos=True``;
sampling is temperature-only (top_k=0, top_p=1), as in nanoserve's SamplingParams. ``auto_switch_to_flash=False``
keeps HF on sdpa even where a flash kernel would be found. HF's defaults are kept otherwise (page size, memory
fraction, CUDA graphs, async batching, prefix block sharing).
"""

from __future__ import annotations

import gc
import inspect
import logging
import statistics
import time
import traceback

import torch

from benchmarks.workloads import Request

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _accepted(fn, kwargs: dict) -> dict:
    """The kwargs ``fn`` accepts (the continuous-batching API moved between transformers 5.x releases)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


class HFPeer:
    def __init__(
        self,
        model_dir: str,
        *,
        device: str = "cuda",
        dtype: str = "bfloat16",
        temperature: float = 0.6,
        max_prompt_len: int = 0,
        max_new_tokens: int = 0,
        num_requests: int = 0,
        seed: int = 0,
    ) -> None:
        self.model_dir = str(model_dir)
        self.device = device
        self.dtype = _DTYPES[dtype]
        self.temperature = temperature
        self.hints = (max_prompt_len, max_new_tokens, num_requests)
        self.seed = seed
        self.model = None
        self.manager = None
        self._cm = None
        self._batches = 0

    # ---- lifecycle ---------------------------------------------------------------------------------------

    def __enter__(self) -> HFPeer:
        from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

        torch.manual_seed(self.seed)
        config = AutoConfig.from_pretrained(self.model_dir)
        with torch.device(self.device):
            model = AutoModelForCausalLM.from_config(config, dtype=self.dtype, attn_implementation="sdpa")
        self.model = model.eval()
        sample = self.temperature > 0
        gen = GenerationConfig(
            do_sample=sample,
            temperature=self.temperature if sample else None,
            top_k=0 if sample else None,
            top_p=1.0 if sample else None,
            max_new_tokens=max(1, self.hints[1]),
            eos_token_id=-1,
            pad_token_id=0,
        )
        kwargs = {"generation_config": gen, "block": True, "timeout": 30}
        try:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig

            cb_kwargs = _accepted(ContinuousBatchingConfig, {"auto_switch_to_flash": False})
            kwargs["continuous_batching_config"] = ContinuousBatchingConfig(**cb_kwargs)
        except ImportError:
            pass
        try:
            from transformers.generation.continuous_batching.utils import WorkloadHints

            p, m, n = self.hints
            kwargs["workload_hints"] = WorkloadHints(max_prompt_length=p, max_generated_length=m, num_requests=n)
        except ImportError:
            pass
        self._cm = self.model.continuous_batching_context_manager(
            **_accepted(self.model.continuous_batching_context_manager, kwargs)
        )
        self.manager = self._cm.__enter__()
        if "max_new_tokens" not in inspect.signature(self.manager.add_request).parameters:
            self.__exit__(None, None, None)
            raise RuntimeError("this transformers has no per-request max_new_tokens in ContinuousBatchingManager")
        return self

    def __exit__(self, *exc) -> None:
        if self._cm is not None:
            cm, self._cm = self._cm, None
            try:
                cm.__exit__(None, None, None)
            except Exception as e:  # a failed stop must not hide the benchmark's own error
                logging.getLogger("nanoserve.bench").warning("HF manager did not stop cleanly: %s", e)
        self.manager = None
        self.model = None
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()

    # ---- running -----------------------------------------------------------------------------------------

    def warmup(self, num_tokens: int = 16, max_new_tokens: int = 8) -> None:
        self.run([list(range(1, num_tokens + 1))], [max_new_tokens])

    def run(self, prompts: list[list[int]], max_new_tokens: list[int], timeout_s: float = 3600) -> tuple[float, int]:
        """Submit all requests at once, wait for all; returns (wall seconds, output tokens generated)."""
        if self.manager is None:
            raise RuntimeError("HFPeer.run outside its `with` block")
        self._batches += 1
        manager = self.manager
        t0 = time.perf_counter()
        ids = set()
        for i, (prompt, m) in enumerate(zip(prompts, max_new_tokens)):
            rid = manager.add_request(input_ids=list(prompt), request_id=f"b{self._batches}-{i}", max_new_tokens=m)
            ids.add(rid)
        done: dict[str, object] = {}
        deadline = time.monotonic() + timeout_s
        while len(done) < len(ids):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError(f"HF generation thread stopped with {len(ids) - len(done)} requests unfinished")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"HF peer: {len(ids) - len(done)} requests unfinished after {timeout_s} s")
                continue
            if result.request_id in ids and result.is_finished():
                if getattr(result, "error", None):
                    raise RuntimeError(f"HF request {result.request_id} failed: {result.error}")
                done[result.request_id] = result
        seconds = time.perf_counter() - t0
        return seconds, sum(len(r.generated_tokens) for r in done.values())


# ---- the peer's runs for benchmarks/throughput.py (after nanoserve's engine is closed) ----------------------


def hf_safely(fn, *args) -> dict:
    """Run an HF peer measurement; a failure is reported (stderr + ``hf_error``) without losing nanoserve's run."""
    try:
        return fn(*args)
    except Exception as e:
        traceback.print_exc()
        return {"hf_error": f"{type(e).__name__}: {e}"}


def hf_batch(ctx: dict, sub: list[Request]) -> dict:
    hints = {"max_prompt_len": max(len(r.prompt) for r in sub), "max_new_tokens": max(r.max_tokens for r in sub)}
    with HFPeer(**ctx["hf_kwargs"], **hints, num_requests=len(sub)) as peer:
        peer.warmup()
        hf_s, hf_tokens = peer.run([r.prompt for r in sub], [r.max_tokens for r in sub])
    return {"hf_seconds": hf_s, "hf_output_tokens": hf_tokens, "hf_tok_s": hf_tokens / hf_s}


def hf_single_stream(ctx: dict, prompts: list[list[int]], m: int) -> dict:
    hints = {"max_prompt_len": len(prompts[0]), "max_new_tokens": m, "num_requests": 1}
    with HFPeer(**{**ctx["hf_kwargs"], "temperature": 0.0}, **hints) as peer:
        peer.warmup()
        hf_ttft = statistics.median(peer.run([p], [1])[0] for p in prompts[:3])
        hf_s, hf_tokens = peer.run([prompts[3]], [m])
    return {
        "hf_seconds": hf_s,
        "hf_output_tokens": hf_tokens,
        "hf_tok_s": hf_tokens / hf_s,
        "hf_ttft_ms": hf_ttft * 1e3,
        "hf_ms_per_token": (hf_s - hf_ttft) / (m - 1) * 1e3,
    }
