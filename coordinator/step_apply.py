"""A step's result applied to its sequences: tokens appended (or in-flight placeholders resolved), the token-level
stop checked after every token, the output processor fed, finished requests ended.

A verify row (speculative decoding) brings 1 + a tokens: the a accepted drafts and the target's own. They are
applied one by one exactly as a run of decode steps would be, so a stop (EOS, stop id, stop string, max_tokens)
inside the run drops the tokens after it; the sequence's computed length then counts only the accepted positions
(the rejected drafts' K/V is overwritten later), and a streamed request gets one output for the whole run."""

from __future__ import annotations

import numpy as np

from coordinator.scheduler import ScheduledBatch
from coordinator.sequence import SeqStatus
from coordinator.structured_outputs import grammar_stop
from protocol.messages import StepResult
from protocol.outputs import StepOutput


class ResultApplier:
    """The engine's application of a step's result (a mixin of coordinator.engine.Engine: ``self`` is the engine)."""

    def apply_result(self, batch: ScheduledBatch, result: StepResult) -> list[StepOutput]:
        tokens = result.token_ids.tolist()
        prompt_tokens = sum(n for n in batch.num_tokens if n > 1)
        counts = None  # tokens per sampled row: one, unless the step had verify rows
        if batch.drafts is not None:
            if result.num_accepted is None:
                raise RuntimeError(f"step {batch.step.step_id} had verify rows but its result has no num_accepted")
            drafts, accepted = np.asarray(batch.drafts), result.num_accepted.astype(np.int64)
            verify = drafts > 0
            self.scheduler.speculator.stats.record(drafts[verify], accepted[verify])
            prompt_tokens -= int((1 + drafts[verify]).sum())
            counts = (1 + accepted).tolist()
            drafts, accepted = drafts.tolist(), accepted.tolist()
        self.num_prompt_tokens_computed += prompt_tokens
        self.num_output_tokens += len(tokens)
        lp_ids = lp_values = None
        offset = pos = 0
        if result.logprob_token_ids is not None:
            lp_ids, lp_values = result.logprob_token_ids.tolist(), result.logprobs.tolist()
        processor = self.output_processor
        if result.prompt_logprob_index is not None:  # before the tokens: a request's last output carries them
            idx, ids, values = result.prompt_logprob_index, result.prompt_logprob_token_ids, result.prompt_logprobs
            processor.add_prompt_logprobs(batch.seqs, idx, ids, values)
        outputs = []
        for row, seq in enumerate(batch.sampled):
            count = 1 if counts is None else counts[row]
            row_tokens = tokens[pos : pos + count]
            pos += count
            if counts is not None and drafts[row]:
                self.scheduler.speculator.verified(seq, accepted[row], self.scheduler.step_id)
                if seq.status is SeqStatus.RUNNING:  # only the accepted positions stay computed
                    seq.num_computed_tokens -= drafts[row] - accepted[row]
            row_outputs = []
            for token in row_tokens:
                logprobs = None
                if seq.params.logprobs is not None and lp_ids is not None:
                    # the token, then the top N: 1 + N entries for every emitted token of a row that asked
                    end = offset + 1 + seq.params.logprobs
                    logprobs = dict(zip(lp_ids[offset:end], lp_values[offset:end]))
                    offset = end
                if seq.status is SeqStatus.FINISHED:
                    continue  # aborted, stopped one step earlier, or earlier in this run
                if seq.num_pending:
                    seq.resolve_pending(token)
                else:
                    seq.token_ids.append(token)
                stop = seq.token_stop(token, self.eos_token_ids)
                if seq.grammar is not None and stop is None:
                    stop = grammar_stop(seq.grammar, token)
                if stop is None and not seq.every_token:
                    continue  # the output processor only needs this request's last token
                out = processor.update(seq, token, logprobs, stop)
                if out is None:
                    continue
                if out.finish_reason is not None:  # a token-level stop, or a stop string the processor found
                    self.scheduler.finish(seq, out.finish_reason)
                    self.requests.pop(seq.request_id, None)
                    self.num_constrained -= seq.params.structured_outputs is not None
                row_outputs.append(out)
            if row_outputs:
                outputs.append(row_outputs[0] if len(row_outputs) == 1 else _joined(row_outputs))
        return outputs


def _joined(outs: list[StepOutput]) -> StepOutput:
    """One streamed output for a run of tokens: the new tokens, text and logprobs in order, the last one's end."""
    last = outs[-1]
    logprobs = None if last.logprobs is None else [lp for o in outs for lp in o.logprobs]
    return StepOutput(
        last.request_id,
        [t for o in outs for t in o.token_ids],
        "".join(o.text for o in outs),
        logprobs,
        last.finish_reason,
        last.stop_reason,
        last.prompt_token_ids,
        last.prompt_logprobs,
        last.num_prompt_tokens,
    )
