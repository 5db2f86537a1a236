"""The offline API, vLLM-style: ``LLM(model).generate(prompts, params)``.

The coordinator runs in this process and drives worker processes over the same ZMQ/msgpack protocol that
``launch.py`` uses: there is no shortcut path. Completions come from the engine's output processor, as the server's
replies do.
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
        request_ids: list[str] = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                request_ids.append(engine.add_request(prompt, params))
        except BaseException:
            for rid in request_ids:
                engine.abort(rid)
            raise
        done: dict[str, Completion | None] = dict.fromkeys(request_ids)
        left = len(request_ids)
        bar = _Progress(engine, left) if use_tqdm else None
        try:
            while left:
                t0 = time.perf_counter()
                finished = 0
                for out in engine.step():  # a request that is not streamed has one output: its last
                    if out.request_id in done:
                        done[out.request_id] = out.completion()
                        finished += 1
                left -= finished
                if bar is not None:
                    bar.update(time.perf_counter() - t0, finished)
        except BaseException:
            for rid in request_ids:
                engine.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[rid] for rid in request_ids]

    def stats(self) -> dict:
        return self.engine.stats()

    def close(self) -> None:
        if self.engine is not None:
            self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Progress:
    """A tqdm bar of finished requests, with the last step's prefill or decode rate."""

    def __init__(self, engine: Engine, total: int) -> None:
        from tqdm.auto import tqdm

        self.engine = engine
        self.bar = tqdm(total=total, desc="Generating", dynamic_ncols=True)
        s = engine.stats()
        self.prompt_tokens, self.output_tokens = s["prompt_tokens"], s["output_tokens"]

    def update(self, seconds: float, finished: int) -> None:
        """One step took ``seconds`` and finished ``finished`` requests."""
        s = self.engine.stats()
        prefill, decode = s["prompt_tokens"] - self.prompt_tokens, s["output_tokens"] - self.output_tokens
        self.prompt_tokens, self.output_tokens = s["prompt_tokens"], s["output_tokens"]
        dt = max(seconds, 1e-9)
        if prefill:
            self.bar.set_postfix_str(f"prefill {prefill / dt:,.0f} tok/s", refresh=False)
        elif decode:
            self.bar.set_postfix_str(f"decode {decode / dt:,.0f} tok/s", refresh=False)
        self.bar.update(finished)

    def close(self) -> None:
        self.bar.close()
