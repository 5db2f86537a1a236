"""The offline API in vLLM's shape: ``LLM(model).generate(prompts, params)`` and ``LLM.chat(messages, params)``
return ``RequestOutput``s (``.prompt``, ``.prompt_token_ids``, ``.outputs[i].text`` ...), so vLLM's quickstart runs
with only its import line changed.

The coordinator runs in this process and drives worker processes over the same ZMQ/msgpack protocol that
``launch.py`` uses: there is no shortcut path.
"""

from __future__ import annotations

import atexit
import dataclasses
import time
import weakref

from coordinator.config import EngineConfig
from coordinator.engine import Engine
from coordinator.prompts import render_chat
from protocol.client_messages import ChatPrompt
from protocol.outputs import Completion, CompletionOutput, RequestOutput
from protocol.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str = "", tensor_parallel_size: int = 1, **engine_args) -> None:
        self.engine = None
        cfg = EngineConfig.from_kwargs(model=model, tensor_parallel_size=tensor_parallel_size, **engine_args)
        self.engine = Engine(cfg)
        self.tokenizer = self.engine.tokenizer
        # close at interpreter exit too, so no worker outlives us
        self._finalizer = weakref.finalize(self, Engine.shutdown, self.engine)
        atexit.register(self._finalizer)

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order. A prompt is a string, a token-id list,
        ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}`` (or a list of those); ``n > 1`` samples n outputs
        of a prompt, which share its KV blocks through the prefix cache."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [_prompt_input(p) for p in prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        runs = [(p, sp) for p, params in zip(prompts, sampling_params) for sp in _samples(params)]
        t0 = time.time()
        done = iter(self._run([p for p, _ in runs], [sp for _, sp in runs], use_tqdm))
        metrics = {"arrival_time": t0, "finished_time": time.time()}
        out = []
        for prompt, params in zip(prompts, sampling_params):
            samples = [next(done) for _ in range(params.n)]
            first = samples[0]
            out.append(
                RequestOutput(
                    request_id=first.request_id,
                    prompt=prompt if isinstance(prompt, str) else None,
                    prompt_token_ids=first.prompt_token_ids,
                    outputs=[CompletionOutput.from_completion(i, c) for i, c in enumerate(samples)],
                    metrics=dict(metrics),
                )
            )
        return out

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template_kwargs: dict | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Replies to one conversation ([{"role", "content"}]) or a list of them, through the model's chat
        template; ``RequestOutput.prompt`` is the rendered prompt text."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        texts = [
            render_chat(self.tokenizer, ChatPrompt(list(c), chat_template_kwargs, add_generation_prompt))
            for c in conversations
        ]
        return self.generate(texts, sampling_params, use_tqdm)

    def get_tokenizer(self):
        return self.tokenizer

    def _run(self, prompts: list, sampling_params: list[SamplingParams], use_tqdm: bool) -> list[Completion]:
        engine = self.engine
        seqs = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                seqs.append(engine.add_request(prompt, params))
        except BaseException:
            for seq in seqs:
                engine.abort(seq.request_id)
            raise
        bar = _progress(len(seqs)) if use_tqdm else None
        try:
            while any(not s.is_finished for s in seqs):
                t0 = time.perf_counter()
                prompt_before, output_before = engine.num_prompt_tokens_computed, engine.num_output_tokens
                outputs = engine.step()
                if bar is not None:
                    dt = max(time.perf_counter() - t0, 1e-9)
                    prefill = engine.num_prompt_tokens_computed - prompt_before
                    decode = engine.num_output_tokens - output_before
                    if prefill:
                        bar.set_postfix_str(f"prefill {prefill / dt:,.0f} tok/s", refresh=False)
                    elif decode:
                        bar.set_postfix_str(f"decode {decode / dt:,.0f} tok/s", refresh=False)
                    bar.update(sum(o.finished for o in outputs))
        except BaseException:
            for seq in seqs:
                engine.abort(seq.request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [engine.completion(s) for s in seqs]

    def stats(self) -> dict:
        return self.engine.stats()

    def close(self) -> None:
        if self.engine is not None:
            self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _prompt_input(p):
    """A prompt as the engine takes it: a string or a token-id list."""
    if isinstance(p, dict):
        if "prompt_token_ids" in p:
            return list(p["prompt_token_ids"])
        if "prompt" in p:
            return p["prompt"]
        raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(p)}")
    return p


def _samples(params: SamplingParams) -> list[SamplingParams]:
    """A request's n samples as n engine requests (n=1 each; seeded: seed + index, so they differ)."""
    if params.n == 1:
        return [params]
    seeds = [None] * params.n if params.seed is None else [(params.seed + i) % 2**63 for i in range(params.n)]
    return [dataclasses.replace(params, n=1, seed=s) for s in seeds]


def _progress(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Generating", dynamic_ncols=True)
