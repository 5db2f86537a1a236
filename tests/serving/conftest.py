"""The ZMQ serving tests' shared fixtures: one ``python launch.py`` server per test module, with the request and
frame limits of tests/support/server.py, and the offline API's greedy outputs to compare it with."""

from __future__ import annotations

import pytest

from client import SamplingParams
from tests.support.server import ENGINE_KWARGS, MAX_MESSAGE_BYTES, MAX_PENDING, ServerProcess


@pytest.fixture(scope="module")
def server(tiny_tied, tmp_path_factory):
    flags = ["--max-pending-requests", str(MAX_PENDING), "--max-message-bytes", str(MAX_MESSAGE_BYTES)]
    with ServerProcess(tiny_tied, tmp_path_factory.mktemp("server") / "server.log", *flags) as srv:
        yield srv


@pytest.fixture(scope="module")
def offline(tiny_tied):
    """Greedy outputs of the offline API, computed once per prompt with a long budget (shorter requests
    are prefixes of these: ignore_eos, greedy)."""
    from nanoserve import LLM

    with LLM(str(tiny_tied), **ENGINE_KWARGS) as llm:
        cache: dict = {}
        greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)

        def key(prompt):
            return prompt if isinstance(prompt, str) else tuple(prompt)

        def prefetch(prompts) -> None:
            """The outputs of every prompt not computed yet, in one batch (one decode instead of one per prompt)."""
            todo = list({key(p): p for p in prompts if key(p) not in cache}.values())
            for p, c in zip(todo, llm.generate(todo, greedy, False) if todo else []):
                cache[key(p)] = c

        def expect(prompt, max_tokens: int = 48):
            prefetch([prompt])
            c = cache[key(prompt)]
            return c.token_ids[:max_tokens], llm.tokenizer.decode(c.token_ids[:max_tokens], skip_special_tokens=True)

        expect.prefetch = prefetch
        expect.llm = llm
        expect.tokenizer = llm.tokenizer
        expect.generate = llm.generate
        yield expect
