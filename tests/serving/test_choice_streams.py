"""The front-end's ChoiceStreams against ``python launch.py`` (conftest.py's server): whether a request's first
deltas come within the headers' wait or after it (then the response starts and they follow), every choice's stream
arrives whole, the same as when waited for. With one choice the wait runs in the caller's task
(AsyncStream.next_within), whose timeout must leave the reply queue as it was."""

from __future__ import annotations

import asyncio

import pytest

from openai_server.engine_client import EngineClient
from openai_server.streaming import ChoiceStreams
from protocol.sampling_params import SamplingParams
from tests.support.timeouts import HANG_S, START_S

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


async def _collect(engine: EngineClient, jobs: list[tuple], wait_s: float) -> tuple[int, dict[int, list[int]]]:
    streams = ChoiceStreams(engine, jobs)
    await streams.start(wait_s)
    early = len(streams.firsts)
    out: dict[int, list[int]] = {i: [] for i in range(len(jobs))}
    async for i, d in streams.deltas():
        out[i] += d.token_ids
    return early, out


@pytest.mark.parametrize("choices", [1, 3])
def test_every_delta_arrives_whether_the_first_came_within_the_wait_or_not(server, choices):
    prompt = [11, 12, 13, 14, 15]
    jobs = [(prompt, GREEDY)] * choices

    async def main():
        engine = EngineClient(server.address, None)
        await engine.connect(START_S)
        try:
            waited = await asyncio.wait_for(_collect(engine, jobs, HANG_S), HANG_S)
            late = await asyncio.wait_for(_collect(engine, jobs, 0), HANG_S)  # the response starts before them
        finally:
            await engine.close()
        return waited, late

    (early_w, waited), (early_l, late) = asyncio.run(main())
    assert early_w == choices and early_l == 0
    assert late == waited and all(len(ids) == GREEDY.max_tokens for ids in waited.values())
