"""Held-out perplexity of a checkpoint trained by training/train_default_model.py, through nanoserve's engine
(prompt logprobs of ``LLM.generate``: bf16, FP8 weights, an FP8 KV cache) beside HF transformers' bf16 forward on
the same token windows.

    python -m training.evaluate_default_model MODEL_DIR [--window 1024] [--max-windows 0] [--runs bf16,fp8,fp8-kv,hf]

The held-out text is training/corpus.py's held-out files of this Python's standard library, tokenized by the
model's own tokenizer, each file followed by <|endoftext|>, cut into windows of ``--window`` tokens. Every
position after a window's first is scored; perplexity is exp(mean negative log-likelihood). Prefills are chunked
(``--chunk`` tokens a step), so later chunks read the earlier keys and values back from the (FP8) KV cache.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from training.corpus import documents, python_version, split, stdlib_files, stdlib_root
from training.train_default_model import token_stream

SAMPLE_PROMPTS = ["def fibonacci(n):", "class Stack:\n    def push(self, item):", "import os\n\n\ndef list_files("]
ENGINE_RUNS = {"bf16": {}, "fp8": {"quantization": "fp8"}, "fp8-kv": {"kv_cache_dtype": "fp8"}}


def held_out_windows(model_dir: Path, window: int, max_windows: int, stdlib: Path | None = None) -> np.ndarray:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    _, held = split(stdlib_files(stdlib_root(stdlib)))
    stream = token_stream(tokenizer, documents(held, with_chat=False), seed=0)
    n = len(stream) // window
    n = min(n, max_windows) if max_windows else n
    return stream[: n * window].reshape(n, window).astype(np.int64)


def engine_run(model_dir: Path, windows: np.ndarray, chunk: int, device: str, sample: bool, **engine_args):
    """(mean negative log-likelihood of every window position after the first, from nanoserve's prompt logprobs;
    with ``sample``: greedy completions of SAMPLE_PROMPTS and one chat reply, from the same engine)."""
    from nanoserve import LLM, SamplingParams

    window = windows.shape[1]
    # the model's max_model_len; eager: prefill-only work, no graphs worth their capture time
    args = dict(dtype="bfloat16", max_num_batched_tokens=chunk, enable_prefix_caching=False, enforce_eager=True)
    texts = []
    with LLM(str(model_dir), device=device, **args, **engine_args) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        outs = llm.generate([{"prompt_token_ids": w.tolist()} for w in windows], params, use_tqdm=False)
        if sample:
            greedy = SamplingParams(temperature=0.0, max_tokens=64)
            for prompt, out in zip(SAMPLE_PROMPTS, llm.generate(SAMPLE_PROMPTS, greedy, use_tqdm=False)):
                texts.append(prompt + out.outputs[0].text)
            chat = [
                {"role": "user", "content": "Write a Python function `fibonacci`: Return the n-th Fibonacci number."}
            ]
            texts.append(llm.chat(chat, greedy, use_tqdm=False)[0].outputs[0].text)
    total = 0.0
    for w, out in zip(windows, outs):
        entries = out.prompt_logprobs[1:]
        total -= sum(e[int(t)].logprob for e, t in zip(entries, w[1:]))
    return total / (windows.shape[0] * (window - 1)), texts


def hf_nll(model_dir: Path, windows: np.ndarray, device: str, batch: int = 16) -> float:
    """The same quantity from HF transformers' Qwen3ForCausalLM in bf16 (log-softmax in float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            x = torch.from_numpy(windows[i : i + batch]).to(device)
            logp = model(input_ids=x).logits[:, :-1].float().log_softmax(-1)
            total -= logp.gather(-1, x[:, 1:, None]).sum().item()
    return total / (windows.shape[0] * (windows.shape[1] - 1))


def main(argv: list[str] | None = None) -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("model_dir", type=Path, help="the checkpoint directory")
    p.add_argument("--window", type=int, default=1024, help="tokens per scored window")
    p.add_argument("--max-windows", type=int, default=0, help="score the first N windows only (0: all)")
    p.add_argument("--chunk", type=int, default=256, help="the engine's max_num_batched_tokens (prefill chunk)")
    p.add_argument("--runs", default="bf16,fp8,fp8-kv,hf", help="comma-separated: bf16, fp8, fp8-kv, hf")
    p.add_argument("--stdlib", type=Path, help="the standard library's directory (default: this Python's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    windows = held_out_windows(args.model_dir, args.window, args.max_windows, args.stdlib)
    print(
        f"python {python_version(args.stdlib)} held-out: {windows.shape[0]} windows of {args.window} tokens", flush=True
    )
    results, record_samples = {}, []
    for run in args.runs.split(","):
        t0 = time.time()
        try:
            if run == "hf":
                nll = hf_nll(args.model_dir, windows, args.device)
            else:
                sample = not record_samples
                nll, texts = engine_run(args.model_dir, windows, args.chunk, args.device, sample, **ENGINE_RUNS[run])
                record_samples += texts
            results[run] = {"nll": round(nll, 5), "ppl": round(math.exp(nll), 4), "seconds": round(time.time() - t0, 1)}
        except Exception as e:  # one run's failure must not cost the others' numbers
            results[run] = {"error": f"{type(e).__name__}: {e}"[:500]}
        print(run, results[run], flush=True)
    for text in record_samples:
        print(f"--- sample ---\n{text}\n", flush=True)
    results["samples"] = record_samples
    record = {"python": python_version(args.stdlib), "windows": int(windows.shape[0]), "window": args.window, **results}
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    print("| run | held-out ppl | nll |\n|---|---|---|")
    for run, r in results.items():
        if run == "samples":
            continue
        print(f"| {run} | {r.get('ppl', r.get('error'))} | {r.get('nll', '')} |")


if __name__ == "__main__":
    main()
