"""The async and command-line ZMQ clients against ``python launch.py`` in a subprocess (the fixtures: conftest.py):
their greedy outputs equal the offline ``LLM`` API's, errors come back as exceptions, and a cancelled task or a
stream left early aborts its request on the server."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from client import AsyncClient, EngineDeadError, MessageTooLargeError, RequestError, SamplingParams
from tests.support.processes import ROOT
from tests.support.server import MAX_MESSAGE_BYTES, some_prompts
from tests.support.timeouts import HANG_S, START_S

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_async_client(server, offline):
    prompts = some_prompts(8, seed=9)
    offline.prefetch(prompts)

    async def main():
        async with AsyncClient(server.address) as c:
            assert (await c.health())["healthy"]
            info = await c.info()
            assert info["max_model_len"] == 1024 and info["tensor_parallel_size"] == 1 and info["worker_pids"]
            comps = await asyncio.gather(*(c.generate(p, GREEDY) for p in prompts))
            assert [x.token_ids for x in comps] == [offline(p, GREEDY.max_tokens)[0] for p in prompts]
            many = await c.generate_many(prompts, GREEDY)
            assert [x.token_ids for x in many] == [x.token_ids for x in comps]

            async def collect(p):
                ids, text = [], ""
                async for d in c.stream(p, GREEDY):
                    ids += d.token_ids
                    text += d.text
                return ids, text

            streamed = await asyncio.gather(*(collect(p) for p in prompts))
            assert streamed == [offline(p, GREEDY.max_tokens) for p in prompts]
            with pytest.raises(RequestError, match="max_tokens"):
                await c.generate("x", SamplingParams(max_tokens=2000))
            with pytest.raises(RequestError, match="prompt"):
                await c.generate(3.5)
            # cancelling the task that awaits a request aborts it on the server
            long = SamplingParams(max_tokens=900, ignore_eos=True)
            before = await c.stats()
            task = asyncio.create_task(c.generate(list(range(5, 30)), long))
            while (await c.stats())["running"] == 0:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # and so does leaving a stream early
            stream = c.stream(list(range(5, 30)), long)
            async for _ in stream:
                break
            await stream.aclose()
            deadline = time.monotonic() + HANG_S
            while (s := await c.stats())["pending"] and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert s["pending"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]
            assert s["requests_aborted"] == before["requests_aborted"] + 2

    asyncio.run(asyncio.wait_for(main(), START_S))  # only stops a hang


def test_async_client_refuses_requests_over_the_message_limit(server):
    """As the blocking client (test_serving.py): refused before sending, nothing left waiting; Info teaches the
    server's own limit."""

    big = [300] * 1000  # token ids: about 3,000 bytes encoded

    async def main():
        async with AsyncClient(server.address, max_message_bytes=2048) as c:
            with pytest.raises(MessageTooLargeError, match="prompt: .* limit of 2048 bytes"):
                c.stream(big)
            with pytest.raises(MessageTooLargeError, match="token_ids: "):
                await c.detokenize(big)
            with pytest.raises(MessageTooLargeError):
                await c.generate_many([[7] * 8, big], SamplingParams(max_tokens=500, ignore_eos=True))
            assert not c._queues
            assert (await c.info())["max_message_bytes"] == MAX_MESSAGE_BYTES == c.max_message_bytes
            assert len((await c.generate(big, SamplingParams(max_tokens=2))).token_ids) == 2
            s = await c.stats()
            assert s["pending"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]

    asyncio.run(asyncio.wait_for(main(), START_S))  # only stops a hang


def test_cli_client_streams_to_terminal(server, offline):
    ids, text = offline("hello world", 16)
    out = subprocess.run(
        [sys.executable, "-m", "client", "--address", server.address, "--temperature", "0", "--max-tokens", "16"]
        + ["--ignore-eos", "hello", "world"],
        cwd=ROOT,
        env=dict(os.environ, PYTHONIOENCODING="utf-8"),
        capture_output=True,
        timeout=START_S,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.decode("utf-8") == text + "\n"
    assert b"finish_reason=length" in out.stderr


def test_errors_are_exceptions():
    assert issubclass(EngineDeadError, RuntimeError) and issubclass(RequestError, ValueError)


def test_one_client_serves_one_event_loop_after_another(server, offline):
    """The client's reader follows the running loop: the same AsyncClient answers under a second asyncio.run (its
    first loop closed), replies still reach their own requests, and a stream left early is aborted there too."""
    prompts = some_prompts(3, seed=21)
    offline.prefetch(prompts)
    client = AsyncClient(server.address, timeout=HANG_S)

    async def batch():
        outs = await asyncio.gather(*(client.generate(p, GREEDY) for p in prompts))
        async for _ in client.stream(prompts[0], GREEDY):
            break  # left after the first delta: aborted on the server
        return [c.token_ids for c in outs]

    try:
        want = [offline(p, GREEDY.max_tokens)[0] for p in prompts]
        assert asyncio.run(batch()) == want
        assert asyncio.run(batch()) == want
    finally:
        client.close()
