"""The one owner of a request's output text: incremental detokenizing, stop strings (and the streamed text held back
because it may still become one), special tokens, logprobs per token, prompt logprobs (vLLM's ``Logprob`` entries,
with each token's text), and the ``StepOutput``s a step returns.

Token-level stops (EOS, stop ids, max_tokens: ``Sequence.token_stop``) stay with the engine, which schedules by
them; a stop string found here ends the request too, and the engine then finishes its sequence in the scheduler.
As vLLM's: the text of a stop token (EOS, stop id) is left out unless include_stop_str_in_output, and stop strings
only match after the first min_tokens tokens' text. ``LLM`` and the server both consume these outputs and keep no
text state of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from coordinator.detokenizer import TokenTexts, decode_delta
from coordinator.sequence import SeqStatus, Sequence, TokenStop
from protocol.outputs import Logprob, PromptLogprobs, StepOutput
from protocol.sampling_params import SamplingParams


@dataclass(slots=True, eq=False)
class _RequestState:
    request_id: str
    params: SamplingParams
    stream: bool  # a StepOutput every step, with what is new; otherwise one when finished
    detokenize: bool  # the text is built as tokens arrive (streaming or stop strings)
    longest_stop: int  # characters of the longest stop string (0: none)
    holdback: int  # streamed characters held back because they may still start a stop string
    logprobs: list[dict[int, float]] | None  # one per output token, when the request asked
    prompt_logprobs: PromptLogprobs | None  # [None, then one per prompt position received], when it asked
    token_ids: list[int] = field(default_factory=list)  # output tokens, when every token comes through here
    text: str = ""  # complete characters decoded so far, cut at the stop string that ended the request
    prefix_offset: int = 0  # incremental detokenizer state, over token_ids
    read_offset: int = 0
    searched: int = 0  # characters searched, or shielded by min_tokens: a new match must end after them
    sent: int = 0  # characters of text already streamed
    stop_string: str | None = None  # the stop string found in the text


class OutputProcessor:
    """Per-request output state, keyed by the engine's request id."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _RequestState] = {}
        self.token_texts = TokenTexts(tokenizer)  # the process's one cache: prompt logprobs, LLM's, Detokenize

    def add(self, seq: Sequence, stream: bool) -> bool:
        """Track a new request. Returns whether it needs ``update`` for every token (streaming, stop strings or
        logprobs); otherwise only for the token that finishes it."""
        p = seq.params
        detokenize = stream or bool(p.stop)
        longest = max(map(len, p.stop), default=0)
        # a stop string kept in the output needs no hold-back: text up to its end is shown anyway
        holdback = 0 if p.include_stop_str_in_output else max(longest - 1, 0)
        logprobs = [] if p.logprobs is not None else None
        prompt_logprobs = [None] if p.prompt_logprobs is not None else None  # nothing predicts the first token
        self.states[seq.request_id] = _RequestState(
            seq.request_id, p, stream, detokenize, longest, holdback, logprobs, prompt_logprobs
        )
        return detokenize or logprobs is not None

    def add_prompt_logprobs(self, seqs: list[Sequence], index: np.ndarray, ids: np.ndarray, values: np.ndarray) -> None:
        """A step's prompt logprobs (StepResult's fields; ``seqs`` are the step's rows): per position, a
        (row, position, rank) triple in ``index`` and 1 + N entries, the prompt token then the top N. A position
        received before is a recomputation after a preemption and is dropped."""
        ids, values, offset = ids.tolist(), values.tolist(), 0
        for row, position, rank in index.reshape(-1, 3).tolist():
            seq = seqs[row]
            end = offset + 1 + seq.params.prompt_logprobs
            st = self.states.get(seq.request_id)
            if st is not None and seq.status is not SeqStatus.FINISHED:
                received = st.prompt_logprobs
                if position > len(received):
                    raise RuntimeError(f"request {seq.request_id}: prompt logprob {position} before {len(received)}")
                if position == len(received):
                    received.append(self._prompt_entry(ids[offset:end], values[offset:end], rank))
            offset = end

    def _prompt_entry(self, ids: list[int], values: list[float], rank: int) -> dict[int, Logprob]:
        """vLLM's entry: the prompt token (its rank counted by the worker), then the top N, ranked 1..N."""
        texts = self.token_texts.of(ids)
        ranks = [rank, *range(1, len(ids))]
        return {t: Logprob(v, r, texts[t]) for t, v, r in zip(ids, values, ranks)}

    def update(
        self, seq: Sequence, token: int, logprobs: dict[int, float] | None, stop: TokenStop | None
    ) -> StepOutput | None:
        """``token`` was appended to ``seq``; ``stop`` is its token-level stop, if any. Returns the request's
        output for this step (None: nothing to tell yet). A finished output's reason may be a stop string's."""
        st = self.states[seq.request_id]
        finish_reason, stop_reason = stop if stop is not None else (None, None)
        # as vLLM, a stop token's (EOS, stop id) text stays out of the output unless asked for; its id stays in
        drop_last = finish_reason == "stop" and not st.params.include_stop_str_in_output
        if st.detokenize or st.logprobs is not None:  # every token comes through: keep them
            st.token_ids.append(token)
            if st.logprobs is not None:
                st.logprobs.append(logprobs)
        if st.detokenize and not drop_last:
            self._detokenize(st)
            # a stop string on the last allowed token still counts; EOS and stop ids win over it
            if finish_reason in (None, "length") and st.longest_stop:
                if len(st.token_ids) <= st.params.min_tokens:
                    st.searched = len(st.text)  # vLLM: no stop string within the first min_tokens tokens' text
                elif self._find_stop_string(st):
                    finish_reason, stop_reason = "stop", st.stop_string
        if finish_reason is not None:
            return self._final(st, seq, finish_reason, stop_reason, [token], [logprobs], drop_last)
        if not st.stream:
            return None
        new_logprobs = None if st.logprobs is None else [logprobs]
        return StepOutput(
            st.request_id, [token], self._ready_text(st), new_logprobs, num_prompt_tokens=seq.num_prompt_tokens
        )

    def finish(self, seq: Sequence, reason: str) -> StepOutput | None:
        """The request ended outside a step (abort): its last output, with no new tokens."""
        st = self.states.get(seq.request_id)
        return None if st is None else self._final(st, seq, reason, None, [], [])

    # ---- text ----------------------------------------------------------------------------------------------

    def _detokenize(self, st: _RequestState) -> None:
        delta, st.prefix_offset, st.read_offset = decode_delta(
            self.tokenizer, st.token_ids, st.prefix_offset, st.read_offset, st.params.skip_special_tokens
        )
        st.text += delta

    def _find_stop_string(self, st: _RequestState) -> bool:
        """Cut the text at the first stop string (in the request's order) and say whether one was found. Only
        matches that end in the new text count: the text before was searched in earlier steps (or is min_tokens')."""
        p = st.params
        for stop in p.stop:
            idx = st.text.find(stop, max(0, st.searched - len(stop) + 1))
            if idx >= 0:
                st.text = st.text[: idx + len(stop) if p.include_stop_str_in_output else idx]
                st.stop_string = stop
                return True
        st.searched = len(st.text)
        return False

    def _ready_text(self, st: _RequestState) -> str:
        """Streamed text not sent yet, less what may still become a stop string (min_tokens needs no more: no match
        ends within its text)."""
        ready = len(st.text) - st.holdback
        if ready <= st.sent:
            return ""
        text = st.text[st.sent : ready]
        st.sent = ready
        return text

    def _final(
        self,
        st: _RequestState,
        seq: Sequence,
        finish_reason: str,
        stop_reason: str | int | None,
        new_token_ids: list[int],
        new_logprobs: list,
        drop_last: bool = False,
    ) -> StepOutput:
        del self.states[st.request_id]
        if st.stop_string is not None:
            text = st.text
        else:  # decoded once, whole: most requests never needed their text before
            ids = seq.output_token_ids
            ids = ids[:-1] if drop_last else ids  # the stop token's text is left out
            text = self.tokenizer.decode(ids, skip_special_tokens=st.params.skip_special_tokens)
        if st.stream:  # the rest of the text; the whole decode wins where it agrees with what was sent
            sent = st.text[: st.sent]
            text = text[st.sent :] if text.startswith(sent) else st.text[st.sent :]
            token_ids, logprobs = new_token_ids, None if st.logprobs is None else new_logprobs
        else:
            token_ids, logprobs = seq.output_token_ids, st.logprobs
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        return StepOutput(
            st.request_id,
            token_ids,
            text,
            logprobs,
            finish_reason,
            stop_reason,
            prompt,
            st.prompt_logprobs,
            len(prompt),
        )
