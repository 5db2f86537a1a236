"""Real acceptance of n-gram drafts: a code-editing workload on the trained default model, with and without
speculation (one request at a time, as an interactive user runs it; greedy, so both runs must emit the same tokens).

    python -m benchmarks.spec_acceptance [--device cpu|cuda] [--k 3] [--requests 16]

The workload: top-level functions (15-60 lines) of the standard library's held-out files (training/corpus.py: the
default model never trained on them). Each prompt holds a function, a comment asking for the same function renamed,
and the renamed first line; the answer is the rest of the function, so most of it is in the prompt (an edit). The
model is small (6.8M parameters), so how much it copies is its own: acceptance is measured, not assumed. Prints
acceptance per draft position, ms per output token each way and the speedup; the last line is JSON."""

from __future__ import annotations

import argparse
import ast
import json
import time

from model.tiny import default_model_dir
from training.corpus import split, stdlib_files


def edit_prompts(limit: int) -> list[tuple[str, str]]:
    """(prompt, the edited function's remaining text) for up to ``limit`` held-out functions, in file order."""
    out = []
    for _, text in split(stdlib_files())[1]:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines()
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or not 15 <= node.end_lineno - node.lineno + 1 <= 60:
                continue
            source = "\n".join(lines[node.lineno - 1 : node.end_lineno])
            new_name = node.name + "_v2"
            edited = source.replace(f"def {node.name}(", f"def {new_name}(", 1).split("\n", 1)
            prompt = f"{source}\n\n\n# {node.name}, renamed to {new_name}:\n{edited[0]}\n"
            out.append((prompt, edited[1]))
            if len(out) == limit:
                return out
    return out


def run(llm, prompts: list[str], answers: list[str]) -> tuple[list[list[int]], float, int]:
    """Each prompt alone, greedy, up to its answer's length in tokens; (tokens, seconds, output tokens)."""
    from nanoserve import SamplingParams

    outs, seconds = [], 0.0
    for prompt, answer in zip(prompts, answers):
        n = len(llm.tokenizer.encode(answer))
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        outs.append(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
        seconds += time.perf_counter() - t0
    return outs, seconds, sum(len(o) for o in outs)


def main() -> None:
    from nanoserve import LLM

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--requests", type=int, default=16, help="functions edited, one request each")
    p.add_argument("--dtype", default="auto", help="auto: the checkpoint's (bf16; sums may flip near-ties), float32")
    a = p.parse_args()
    work = edit_prompts(a.requests)
    prompts, answers = [w[0] for w in work], [w[1] for w in work]
    spec = {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    eng = {"device": a.device, "dtype": a.dtype} if a.device else {"dtype": a.dtype}
    result = {"requests": len(prompts), "k": a.k, "model": "default (model/default_model)"}
    for name, extra in (("off", {}), ("ngram", {"speculative_config": spec})):
        with LLM(str(default_model_dir()), **eng, **extra) as llm:
            run(llm, prompts[:2], answers[:2])  # warm-up
            before = llm.stats()
            outs, seconds, tokens = run(llm, prompts, answers)
            stats = llm.stats()
        result[name] = {"ms_per_token": 1e3 * seconds / tokens, "output_tokens": tokens, "outputs": outs}
        if name == "ngram":
            drafts = stats["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
            drafted = stats["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
            accepted = stats["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
            per_pos = [
                x - y
                for x, y in zip(
                    stats["spec_decode_num_accepted_tokens_per_pos"], before["spec_decode_num_accepted_tokens_per_pos"]
                )
            ]
            result["drafts"], result["draft_tokens"], result["accepted_tokens"] = drafts, drafted, accepted
            result["acceptance_per_pos"] = [x / max(drafts, 1) for x in per_pos]
            result["acceptance_rate"] = accepted / max(drafted, 1)
            result["mean_accepted_per_draft"] = accepted / max(drafts, 1)
    pairs = list(zip(result["off"].pop("outputs"), result["ngram"].pop("outputs")))
    same = f"{sum(x == y for x, y in pairs)}/{len(pairs)}"
    result["identical_greedy_outputs"] = same  # bf16: a near-tie may flip where a verify row's sums round apart
    result["speedup"] = result["off"]["ms_per_token"] / result["ngram"]["ms_per_token"]
    print(
        f"{len(prompts)} edits, k={a.k}: {result['off']['ms_per_token']:.3f} ms/token without drafts, "
        f"{result['ngram']['ms_per_token']:.3f} with n-gram drafts: {result['speedup']:.2f}x; identical outputs: {same}"
    )
    print(
        "acceptance per position: "
        + ", ".join(f"{x:.2f}" for x in result["acceptance_per_pos"])
        + f"; overall {result['acceptance_rate']:.2f}, {result['mean_accepted_per_draft']:.2f} tokens a draft"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
