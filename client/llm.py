"""The offline API, vLLM-style: ``LLM(model).generate(prompts, params)``.

The coordinator runs in this process and drives worker processes over the same ZMQ/msgpack protocol that
``launch.py`` uses: there is no shortcut path.
"""

from __future__ import annotations

import atexit
import time
import weakref

from coordinator.config import EngineConfig
from coordinator.engine import Engine
from protocol.outputs import Completion
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
        prompts: str | list[int] | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[Completion]:
        """Completions in input order. Prompts are strings or token-id lists."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
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


def _progress(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Generating", dynamic_ncols=True)
