"""Request admission: what ``Engine.admit`` checks before a request is queued (thread-safe: the server runs it on
its tokenizer threads). A request's prompt becomes
token ids (a chat conversation through the tokenizer's template, a string through the tokenizer, token ids checked
against the vocabulary) and its SamplingParams, n, length (prompt + max_tokens against max_model_len and the KV
pool) and token ids (stop ids, logit_bias) are validated; a refusal raises ``RequestError`` naming the problem."""

from __future__ import annotations

from dataclasses import replace

from coordinator.block_manager import BlockManager
from coordinator.prompts import encode_text, render_chat
from protocol.client_messages import ChatPrompt
from protocol.errors import RequestError
from protocol.sampling_params import SamplingParams, truncate_prompt

TOKENIZE_CHARS_FACTOR = 4  # /tokenize's text limit, in multiples of the longest prompt text


class Admission:
    def __init__(self, tokenizer, max_model_len: int, vocab_size: int, block_manager: BlockManager) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.block_manager = block_manager
        longest_token = max((len(t) for t in tokenizer.get_vocab()), default=16)
        # a string longer than this cannot fit in max_model_len tokens: refused before it is tokenized
        self.max_prompt_chars = max_model_len * max(16, 2 * longest_token)
        # /tokenize may count texts longer than a prompt can be, but not without bound
        self.max_tokenize_chars = TOKENIZE_CHARS_FACTOR * self.max_prompt_chars

    def admit(
        self, prompt: str | list[int] | ChatPrompt, params: SamplingParams | None
    ) -> tuple[list[int], SamplingParams]:
        """The request's prompt ids and params, once every check passed (RequestError otherwise)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError("sampling_params must be a SamplingParams")
        try:
            params.validate()  # again: the dataclass is mutable after construction
        except ValueError as e:
            raise RequestError(str(e)) from None
        if params.n != 1:
            raise RequestError(f"n must be 1 per engine request (LLM.generate and the HTTP API send n), got {params.n}")
        whole = params.truncate_prompt_tokens is None  # else a prompt too long is cut, not refused
        ids = truncate_prompt(self.prompt_ids(prompt, whole), params.truncate_prompt_tokens, self.max_model_len)
        if not ids:
            raise RequestError("prompt is empty")
        if len(ids) >= self.max_model_len:  # named as the prompt's fault whatever max_tokens is
            raise RequestError(
                f"prompt ({len(ids)} tokens) leaves no room for output tokens in max_model_len ({self.max_model_len})"
            )
        rest = params.max_tokens is None
        if rest:
            params = self._rest_of_context(params, len(ids))
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"max_model_len ({self.max_model_len})"
            )
        bm = self.block_manager
        if bm.blocks_needed(total) > bm.num_blocks:
            raise RequestError(
                f"prompt + max_tokens = {total} tokens needs more KV blocks than the pool has "
                f"({bm.num_blocks} x {bm.block_size} tokens)"
                + (": max_tokens=None asks for all of max_model_len" if rest else "")
            )
        if params.stop_token_ids and max(params.stop_token_ids) >= self.vocab_size:
            raise RequestError(f"stop_token_ids must be below the vocabulary size {self.vocab_size}")
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise RequestError(f"logit_bias token ids must be below the vocabulary size {self.vocab_size}")
        return ids, params

    def _rest_of_context(self, params: SamplingParams, num_prompt: int) -> SamplingParams:
        """max_tokens=None as vLLM takes it: whatever max_model_len leaves after the prompt."""
        room = self.max_model_len - num_prompt  # >= 1: a prompt that fills the context was refused before
        try:
            return replace(params, max_tokens=room)  # a copy: the caller's params may serve other prompts
        except ValueError as e:  # min_tokens above the room left
            raise RequestError(f"{e} (max_tokens=None: {room} tokens left after the prompt)") from None

    def prompt_ids(self, prompt: str | list[int] | ChatPrompt, whole: bool = False) -> list[int]:
        """The prompt's token ids; ``whole``: a text too long for max_model_len is refused as it is tokenized."""
        if isinstance(prompt, ChatPrompt):  # the template's text carries its own special tokens
            prompt = render_chat(self.tokenizer, prompt, max_chars=self.max_prompt_chars)
        if isinstance(prompt, str):
            if len(prompt) > self.max_prompt_chars:
                raise RequestError(
                    f"prompt ({len(prompt)} characters) cannot fit in max_model_len ({self.max_model_len}) tokens"
                )
            return encode_text(self.tokenizer, prompt, False, self.max_model_len if whole else None)
        # type/min/max run at C speed: W1's 256 prompts (143k ids) were ~10 ms of per-id Python checks
        if isinstance(prompt, (list, tuple)) and set(map(type, prompt)) <= {int}:
            if len(prompt) > self.max_model_len:
                raise RequestError(f"prompt ({len(prompt)} tokens) exceeds max_model_len ({self.max_model_len})")
            if prompt and not (min(prompt) >= 0 and max(prompt) < self.vocab_size):
                bad = [t for t in prompt if not 0 <= t < self.vocab_size]
                raise RequestError(f"prompt token ids out of vocabulary [0, {self.vocab_size}): {bad[:5]}")
            return list(prompt)
        raise RequestError("prompt must be a string or a list of token ids")
