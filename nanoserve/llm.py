"""The offline API in vLLM's shape: ``LLM(model).generate(prompts, params)`` and ``LLM.chat(messages, params)``
return ``RequestOutput``s (``.prompt``, ``.prompt_token_ids``, ``.outputs[i].text`` ...), so vLLM's quickstart runs
with only its import line changed.

The coordinator runs in this process and drives worker processes over the same ZMQ/msgpack protocol that
``launch.py`` uses: there is no shortcut path. Completions come from the engine's output processor, as the server's
replies do.
"""

from __future__ import annotations

import atexit
import time
import weakref

from client.base import chat_prompt
from coordinator.config import EngineConfig
from coordinator.engine import Engine
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
        prompts: str | dict | list,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order. A prompt is a string, a token-id list,
        ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}`` (or a list of those); ``n > 1`` samples n outputs
        of a prompt as n engine requests, which share its KV blocks through the prefix cache. Without
        sampling_params, the model's generation_config.json defaults (as vLLM's)."""
        prompts = _prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or self.engine.admission.default_params()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        for params in sampling_params:
            if not isinstance(params, SamplingParams):
                raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        runs = [(p, sp) for p, params in zip(prompts, sampling_params) for sp in params.choices()]
        t0 = time.time()
        done = iter(self._run([p for p, _ in runs], [sp for _, sp in runs], use_tqdm))
        metrics = {"arrival_time": t0, "finished_time": time.time()}
        out = []
        for prompt, params in zip(prompts, sampling_params):
            samples = [next(done) for _ in range(params.n)]
            first = samples[0]
            texts = self._texts(samples).__getitem__
            out.append(
                RequestOutput(
                    request_id=first.request_id,
                    prompt=prompt if isinstance(prompt, str) else None,
                    prompt_token_ids=first.prompt_token_ids,
                    outputs=[
                        CompletionOutput.from_completion(i, c, params.logprobs, texts) for i, c in enumerate(samples)
                    ],
                    metrics=dict(metrics),
                    prompt_logprobs=first.prompt_logprobs,
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
        chat_template: str | None = None,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Replies to one conversation ([{"role", "content"}]) or a list of them, through ``chat_template`` (a
        Jinja template) or the model's; a content is a string or OpenAI's text parts ([{"type": "text", "text":
        ...}], joined as the HTTP API joins them). ``RequestOutput.prompt`` is the rendered prompt text."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        render = self.engine.admission.render  # the engine's preparation, as for the server's chat requests
        chats = [
            chat_prompt(c, chat_template_kwargs, add_generation_prompt, continue_final_message) for c in conversations
        ]
        return self.generate([render(c, chat_template) for c in chats], sampling_params, use_tqdm)

    def get_tokenizer(self):
        return self.tokenizer

    def _texts(self, samples: list[Completion]) -> dict[int, str]:
        """Each logprob entry's token text (vLLM's ``Logprob.decoded_token``), decoded in one batch per prompt."""
        texts = self.engine.output_processor.token_texts  # the engine's cache: one decode per id in this process
        return texts.of(t for c in samples for entry in c.logprobs or () for t in entry)

    def _run(self, prompts: list, sampling_params: list[SamplingParams], use_tqdm: bool) -> list[Completion]:
        """The engine's Completions of these requests (n=1 each), in order."""
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


_ONE_PROMPT = "a string, a list of token ids, {'prompt': str} or {'prompt_token_ids': [int, ...]}"


def _prompt_list(prompts) -> list:
    """``generate``'s prompts argument as a list of what the engine takes (strings and token-id lists); a
    TypeError naming the accepted forms for anything else."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    elif not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be {_ONE_PROMPT}, or a list of those; got {type(prompts).__name__}")
    elif prompts and _is_token(prompts[0]):
        prompts = [prompts]
    return [_prompt_input(i, p) for i, p in enumerate(prompts)]


def _is_token(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _prompt_input(i: int, p):
    """A prompt as the engine takes it: a string or a token-id list (the engine checks the ids' range)."""
    if isinstance(p, dict):
        if "prompt_token_ids" in p:
            p = p["prompt_token_ids"]
            if not isinstance(p, (list, tuple)):
                raise TypeError(f"prompts[{i}]['prompt_token_ids'] must be a list of token ids, got {type(p).__name__}")
            return list(p)
        if "prompt" in p:
            p = p["prompt"]
            if not isinstance(p, str):
                raise TypeError(f"prompts[{i}]['prompt'] must be a string, got {type(p).__name__}")
            return p
        raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(p)}")
    if isinstance(p, str) or (isinstance(p, (list, tuple)) and (not p or _is_token(p[0]))):
        return p
    raise TypeError(f"prompts[{i}] must be {_ONE_PROMPT}; got {type(p).__name__}")


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
