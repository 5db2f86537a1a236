"""Structured outputs: a request's ``structured_outputs`` (a JSON schema, any JSON object, a regex, a choice or an
EBNF grammar) becomes a grammar matcher (xgrammar, as vLLM and SGLang use) that the engine asks, before each token
the request samples, which tokens keep the output valid. The answer travels to the workers as a bitmask per
sampled row (token i: bit i % 32 of int32 word i // 32), and the sampler sets every other token's logit to -inf.
The engine feeds each sampled token back (``grammar_stop``); a request whose grammar is complete ends.

xgrammar is imported on the first constrained request, so an engine that serves none never loads it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import numpy as np

from coordinator.sequence import SeqStatus
from protocol.errors import RequestError
from protocol.messages import StepMasks

log = logging.getLogger("nanoserve.structured_outputs")

_CACHE_SIZE = 64  # compiled grammars kept, by spec


class Grammars:
    """Compiles specs (on threads, cached) and fills the step's token bitmasks, for one tokenizer and vocabulary."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self._xgrammar = None  # the module, once the first constrained request imported it
        self._compiler = None  # built on a compile thread, under _lock
        self._lock = threading.Lock()
        self._batch = None  # xgrammar's BatchGrammarMatcher: fills many rows' bitmasks on its threads
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._compiling: dict[str, Future] = {}  # specs on the compile threads
        self.pending: dict[str, tuple[object, Future]] = {}  # request id -> (request, its grammar's compile)
        self._pool: ThreadPoolExecutor | None = None

    def _module(self):
        if self._xgrammar is None:
            try:
                import xgrammar
            except ImportError:
                raise RequestError("structured_outputs needs the xgrammar package (pip install xgrammar)") from None
            self._xgrammar = xgrammar
            # a few threads: xgrammar's "auto" counts the host's cores, not this container's, and oversubscribes
            self._batch = xgrammar.BatchGrammarMatcher(max(1, min(4, len(os.sched_getaffinity(0)) // 4)))
        return self._xgrammar

    def _compile(self, grammar):
        """On a compile thread: the grammar against the vocabulary, whose table the first compile builds (0.5 s at
        151,936 tokens)."""
        with self._lock:
            if self._compiler is None:
                info = self._xgrammar.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
                )
                self._compiler = self._xgrammar.GrammarCompiler(info)
        return self._compiler.compile_grammar(grammar)

    def start(self, spec: str) -> Future:
        """The compiled grammar of ``spec`` (SamplingParams.structured_outputs), done at once when cached; else
        compiled on a thread, so the step loop keeps serving meanwhile (a schema takes tens of ms to seconds at a
        150k vocabulary). RequestError naming the field when the spec does not parse (a schema xgrammar cannot
        take, a bad regex or grammar)."""
        xgrammar = self._module()
        compiled = self._compiled.get(spec)
        if compiled is not None:
            self._compiled.move_to_end(spec)
            done: Future = Future()
            done.set_result(compiled)
            return done
        if spec in self._compiling:  # the same spec, asked again before its compile ended
            return self._compiling[spec]
        ((kind, value),) = json.loads(spec).items()
        try:
            grammar = _grammar(xgrammar.Grammar, kind, value)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with its parser's message
            raise RequestError(f"structured_outputs.{kind} does not compile: {e}") from None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")
        future = self._compiling[spec] = self._pool.submit(self._compile, grammar)
        return future

    def matcher(self, spec: str, compiled: Future):
        """A new matcher for ``spec`` from ``start``'s finished future (then cached); RequestError if the compile
        failed."""
        self._compiling.pop(spec, None)
        try:
            grammar = compiled.result()
        except Exception as e:
            raise RequestError(f"structured_outputs does not compile: {e}") from None
        self._compiled[spec] = grammar
        self._compiled.move_to_end(spec)
        if len(self._compiled) > _CACHE_SIZE:
            self._compiled.popitem(last=False)
        return self._xgrammar.GrammarMatcher(grammar)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def attach(self, seq) -> bool:
        """Give a constrained request its matcher; False when its grammar is still compiling: it then waits in
        ``pending`` until ``compiled`` hands it back. RequestError when its spec does not parse."""
        spec = seq.params.structured_outputs
        compiling = self.start(spec)
        if not compiling.done():
            self.pending[seq.request_id] = (seq, compiling)
            return False
        seq.grammar = self.matcher(spec, compiling)
        return True

    def drop(self, request_id: str) -> bool:
        """Forget a pending request (aborted while its grammar compiles); False when it was not pending."""
        entry = self.pending.pop(request_id, None)
        if entry is None:
            return False
        spec = entry[0].params.structured_outputs
        if not any(seq.params.structured_outputs == spec for seq, _ in self.pending.values()):
            self._compiling.pop(spec, None)  # no request waits for it any more
            entry[1].cancel()
        return True

    def compiled(self, idle: bool) -> tuple[list, list]:
        """The pending requests whose compile ended: those that now have their matcher, and those whose compile
        failed (logged, and left pending: the engine aborts them). ``idle``: nothing else to run, so wait up to 5 ms
        for one."""
        if idle:
            wait([f for _, f in self.pending.values()], timeout=0.005, return_when=FIRST_COMPLETED)
        ready, failed = [], []
        for request_id, (seq, compiling) in list(self.pending.items()):
            if compiling.done():
                try:
                    seq.grammar = self.matcher(seq.params.structured_outputs, compiling)
                except RequestError as e:
                    log.error("request %s ends: %s", request_id, e)
                    failed.append(seq)
                    continue
                del self.pending[request_id]
                ready.append(seq)
        return ready, failed

    def add_masks(self, batch, later: bool) -> None:
        """Mark a scheduled batch's constrained sampled rows in its step command, with their bitmasks, or (``later``:
        steps before it are in flight, whose tokens the grammars must see first) for ``due_masks`` to send."""
        rows = [i for i, seq in enumerate(batch.sampled) if seq.grammar is not None]
        if rows:
            batch.step.mask_rows = np.array(rows, np.int32)
            if later:
                batch.masks_due = True
            else:
                batch.step.token_masks = self.token_masks(batch)

    def due_masks(self, in_flight) -> StepMasks | None:
        """The bitmasks of the oldest step in flight, once every step before it is applied, if it awaits them."""
        if not in_flight or not in_flight[0].masks_due:
            return None
        in_flight[0].masks_due = False
        return StepMasks(in_flight[0].step.step_id, self.token_masks(in_flight[0]))

    def token_masks(self, batch) -> np.ndarray:
        """The bitmasks of a batch's marked rows, flattened, from its requests' matchers. Every token of the
        steps before this one must have been fed to them. A request that finished meanwhile (its row's token is
        dropped) gets a mask that allows every token."""
        rows = batch.step.mask_rows
        masks = np.full((len(rows), -(-self.vocab_size // 32)), -1, np.int32)  # every token allowed
        live = [(i, batch.sampled[r]) for i, r in enumerate(rows.tolist())]
        live = [(i, s.grammar) for i, s in live if s.status is not SeqStatus.FINISHED and not s.grammar.is_terminated()]
        if len(live) == 1:
            live[0][1].fill_next_token_bitmask(masks, live[0][0])
        elif live:  # xgrammar's threads fill the rows in parallel, outside the GIL
            self._batch.batch_fill_next_token_bitmask([m for _, m in live], masks, [i for i, _ in live])
        return masks.reshape(-1)


def _grammar(grammar_cls, kind: str, value):
    """The spec as an xgrammar ``Grammar`` (parsed, not yet compiled against the vocabulary)."""
    # JSON without free whitespace between tokens: small models otherwise fill a reply with blank lines
    if kind == "json":
        return grammar_cls.from_json_schema(json.dumps(value), any_whitespace=False)
    if kind == "json_object":
        return grammar_cls.from_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "regex":
        return grammar_cls.from_regex(value)
    if kind == "choice":
        return grammar_cls.from_regex("|".join(re.escape(c) for c in value))
    return grammar_cls.from_ebnf(value)


def grammar_stop(matcher, token: int) -> tuple[str, None] | None:
    """Feed a sampled token to a request's matcher: the request stops ("stop") once its grammar is complete (only a
    stop token could follow), or ("abort"), which its bitmask should prevent, when the grammar refuses the token."""
    if matcher.is_terminated() or not matcher.accept_token(token):
        log.warning("a constrained request sampled token %d, which its grammar refuses", token)
        return ("abort", None)
    return ("stop", None) if matcher.is_terminated() else None
