"""The server's tokenizer threads: chat-template rendering and tokenizing (``Engine.admit``), Tokenize and
Detokenize run here, off the step loop, so one 7 MB text does not stall every other stream. HF's fast tokenizers
release the GIL while they encode (measured: the loop's thread kept running, its longest pause 0.3 s of a 17 s
encode of 7 MB, the list of ids being built); the template (jinja, holding the GIL) is bounded by the prompt's
length, checked before it runs.

The loop submits a job under a key and picks finished ones up without blocking (``finished``); a job it no longer
wants (its request aborted) is cancelled, or its result dropped when it was already running.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from protocol.client_messages import ChatPrompt
from protocol.codec import encode

THREADS = 2  # a few: each big text keeps one core busy, and the step loop needs one too
# a text up to this long is tokenized on the loop (~1 ms): a thread's hand-off would delay its first step
INLINE_CHARS = 8192


@dataclass(slots=True)
class Job:
    key: str
    context: object  # what the loop needs to answer it (its request)
    future: Future


class TokenizerPool:
    def __init__(self, threads: int = THREADS, on_done: Callable[[Future], None] | None = None) -> None:
        self.threads = threads
        self.on_done = on_done  # called on the thread that finished a job (the server's loop wake-up)
        self._pool: ThreadPoolExecutor | None = None  # started on the first job
        self._jobs: dict[str, Job] = {}

    def submit(self, key: str, context: object, fn: Callable, *args) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tokenize")
        future = self._pool.submit(fn, *args)
        if self.on_done is not None:
            future.add_done_callback(self.on_done)
        self._jobs[key] = Job(key, context, future)

    def cancel(self, key: str) -> bool:
        """Forget a job (cancelled if it has not started); False when there was none."""
        job = self._jobs.pop(key, None)
        if job is not None:
            job.future.cancel()
        return job is not None

    def finished(self) -> list[Job]:
        """The jobs done since the last call, in submission order (their futures hold a result or an exception);
        never blocks."""
        if not self._jobs:
            return []
        done = [job for job in self._jobs.values() if job.future.done()]
        for job in done:
            del self._jobs[job.key]
        return done

    def take_all(self) -> list[Job]:
        """Every job not picked up yet, cancelled (their results will not be read)."""
        jobs = list(self._jobs.values())
        for job in jobs:
            job.future.cancel()
        self._jobs.clear()
        return jobs

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, key: str) -> bool:
        return key in self._jobs

    def close(self) -> None:
        """Cancel what has not started; a running encode ends on its own (its thread is not waited for)."""
        self._jobs.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def text_size(prompt) -> int:
    """About how many characters a prompt's template and tokenizer take (0 for token ids)."""
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, ChatPrompt) and isinstance(prompt.messages, list):
        contents = (m.get("content") for m in prompt.messages if isinstance(m, dict))
        return sum(len(c if isinstance(c, str) else str(c)) for c in contents if c is not None) + len(prompt.messages)
    return 0


def encoded(call, msg) -> bytes:
    """``call(msg)``'s reply, encoded for the wire (on a tokenizer thread)."""
    return encode(call(msg))
