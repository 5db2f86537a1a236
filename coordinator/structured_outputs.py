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
from collections import OrderedDict

import numpy as np

from coordinator.sequence import SeqStatus
from protocol.errors import RequestError

log = logging.getLogger("nanoserve.structured_outputs")

_CACHE_SIZE = 64  # compiled grammars kept, by spec


class Grammars:
    """Compiles specs (cached) and fills the step's token bitmasks, for one tokenizer and vocabulary."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self._xgrammar = None  # the module, once the first constrained request imported it
        self._compiler = None
        self._batch = None  # xgrammar's BatchGrammarMatcher: fills many rows' bitmasks on its threads
        self._compiled: OrderedDict[str, object] = OrderedDict()

    def _xgrammar_compiler(self):
        if self._compiler is None:
            try:
                import xgrammar
            except ImportError:
                raise RequestError("structured_outputs needs the xgrammar package (pip install xgrammar)") from None
            info = xgrammar.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
            )
            self._xgrammar, self._compiler = xgrammar, xgrammar.GrammarCompiler(info)
            # a few threads: xgrammar's "auto" counts the host's cores, not this container's, and oversubscribes
            self._batch = xgrammar.BatchGrammarMatcher(max(1, min(4, len(os.sched_getaffinity(0)) // 4)))
        return self._compiler

    def matcher(self, spec: str):
        """A new matcher for ``spec`` (SamplingParams.structured_outputs); RequestError naming the field when it
        does not compile (a schema xgrammar cannot take, a bad regex or grammar)."""
        compiler = self._xgrammar_compiler()
        compiled = self._compiled.get(spec)
        if compiled is None:
            ((kind, value),) = json.loads(spec).items()
            try:
                compiled = _compile(compiler, kind, value)
            except Exception as e:  # xgrammar raises RuntimeError / ValueError with its parser's message
                raise RequestError(f"structured_outputs.{kind} does not compile: {e}") from None
            self._compiled[spec] = compiled
            if len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(spec)
        return self._xgrammar.GrammarMatcher(compiled)

    def mark_rows(self, batch) -> bool:
        """Name a scheduled batch's constrained sampled rows in its step command; False when it has none."""
        rows = [i for i, seq in enumerate(batch.sampled) if seq.grammar is not None]
        if rows:
            batch.step.mask_rows = np.array(rows, np.int32)
        return bool(rows)

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


def _compile(compiler, kind: str, value):
    # JSON without free whitespace between tokens: small models otherwise fill a reply with blank lines
    if kind == "json":
        return compiler.compile_json_schema(json.dumps(value), any_whitespace=False)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(value)
    if kind == "choice":
        return compiler.compile_regex("|".join(re.escape(c) for c in value))
    return compiler.compile_grammar(value)


def grammar_stop(matcher, token: int) -> tuple[str, None] | None:
    """Feed a sampled token to a request's matcher: the request stops ("stop") once its grammar is complete (only a
    stop token could follow), or ("abort"), which its bitmask should prevent, when the grammar refuses the token."""
    if matcher.is_terminated() or not matcher.accept_token(token):
        log.warning("a constrained request sampled token %d, which its grammar refuses", token)
        return ("abort", None)
    return ("stop", None) if matcher.is_terminated() else None
