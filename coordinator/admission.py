"""The one owner of a request's preparation, thread-safe (the server runs it on its tokenizer threads). Every
front-end (the HTTP server, ``Client``, ``LLM``) hands it the raw request: a string, token ids or a chat
conversation (``ChatPrompt``, rendered through the tokenizer's template) and SamplingParams (None: the model's
generation-config defaults). It returns a ``Prepared`` request, or raises ``RequestError`` naming the field:

- the prompt as token ids: rendered, tokenized, cut to its last truncate_prompt_tokens;
- max_tokens resolved: None is the room max_model_len leaves after the prompt, capped by the model's
  max_new_tokens (generation_config.json), as vLLM's server takes an unset max_tokens;
- checked: n, the prompt's length (prompt + max_tokens against max_model_len and the KV pool), token ids (prompt,
  stop ids, logit_bias) against the vocabulary."""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from coordinator.block_manager import BlockManager
from coordinator.prompts import encode_text, no_room, render_chat
from protocol.client_messages import ChatPrompt
from protocol.errors import RequestError
from protocol.sampling_params import SamplingParams

TOKENIZE_CHARS_FACTOR = 4  # /tokenize's text limit, in multiples of the longest prompt text


class Prepared(NamedTuple):
    """A request ready to queue (``Engine.add_admitted``). A tuple: the server unpacks it into that call."""

    prompt_ids: list[int]
    params: SamplingParams  # max_tokens resolved: never None


def truncate_prompt(prompt_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """``prompt_ids`` cut to their last ``keep`` tokens (SamplingParams.truncate_prompt_tokens; -1: max_model_len);
    None leaves them whole."""
    if keep is None:
        return prompt_ids
    keep = max_model_len if keep == -1 else keep
    return prompt_ids[-keep:] if len(prompt_ids) > keep else prompt_ids


class Admission:
    def __init__(
        self,
        tokenizer,
        max_model_len: int,
        vocab_size: int,
        block_manager: BlockManager,
        generation_defaults: dict | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.block_manager = block_manager
        # SamplingParams field -> value, from the model's generation_config.json (coordinator/prompts.py)
        self.generation_defaults = dict(generation_defaults or {})
        longest_token = max((len(t) for t in tokenizer.get_vocab()), default=16)
        # a string longer than this cannot fit in max_model_len tokens: refused before it is tokenized
        self.max_prompt_chars = max_model_len * max(16, 2 * longest_token)
        # /tokenize may count texts longer than a prompt can be, but not without bound
        self.max_tokenize_chars = TOKENIZE_CHARS_FACTOR * self.max_prompt_chars

    def default_params(self) -> SamplingParams:
        """A request's params when it gives none: the model's generation defaults (vLLM's
        ``get_default_sampling_params``); its max_new_tokens, if any, caps max_tokens=None at admission."""
        defaults = self.generation_defaults
        max_tokens = None if "max_tokens" in defaults else SamplingParams().max_tokens
        try:
            return SamplingParams(**{**defaults, "max_tokens": max_tokens})
        except ValueError as e:  # a generation_config.json out of range (its field named)
            raise RequestError(f"{e} (the model's generation_config.json)") from None

    def admit(self, prompt: str | list[int] | ChatPrompt, params: SamplingParams | None) -> Prepared:
        """The request, prepared, once every check passed (RequestError naming the field otherwise)."""
        params = self.default_params() if params is None else params
        if not isinstance(params, SamplingParams):
            raise RequestError("sampling_params must be a SamplingParams")
        if params.n != 1:
            raise RequestError(f"n must be 1 per engine request (LLM.generate and the HTTP API send n), got {params.n}")
        whole = params.truncate_prompt_tokens is None  # else a prompt too long is cut, not refused
        ids = truncate_prompt(self.prompt_ids(prompt, whole), params.truncate_prompt_tokens, self.max_model_len)
        if not ids:
            raise RequestError("prompt is empty")
        if len(ids) >= self.max_model_len:  # named as the prompt's fault whatever max_tokens is
            raise no_room(len(ids), self.max_model_len)
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
        try:  # every field of token ids (SamplingParams' metadata) against the vocabulary
            params.check_token_ids(self.vocab_size)
        except ValueError as e:
            raise RequestError(str(e)) from None
        return Prepared(ids, params)

    def _rest_of_context(self, params: SamplingParams, num_prompt: int) -> SamplingParams:
        """max_tokens=None: whatever max_model_len leaves after the prompt, at most the model's max_new_tokens."""
        room = self.max_model_len - num_prompt  # >= 1: a prompt that fills the context was refused before
        room = min(room, self.generation_defaults.get("max_tokens", room))
        try:
            return replace(params, max_tokens=room)  # a copy: the caller's params may serve other prompts
        except ValueError as e:  # min_tokens above the room left
            raise RequestError(f"{e} (max_tokens=None: {room} tokens left after the prompt)") from None

    def render(self, chat: ChatPrompt, chat_template: str | None = None) -> str:
        """A conversation's prompt text (``LLM.chat`` reports it), through ``chat_template`` or the tokenizer's."""
        return render_chat(self.tokenizer, chat, chat_template)

    def prompt_ids(self, prompt: str | list[int] | ChatPrompt, whole: bool = False) -> list[int]:
        """The prompt's token ids; ``whole``: a prompt too long for max_model_len is refused (a text as it is
        tokenized), else it is left for truncate_prompt_tokens to cut."""
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
            if whole and len(prompt) > self.max_model_len:
                raise RequestError(f"prompt ({len(prompt)} tokens) exceeds max_model_len ({self.max_model_len})")
            if prompt and not (min(prompt) >= 0 and max(prompt) < self.vocab_size):
                bad = [t for t in prompt if not 0 <= t < self.vocab_size]
                raise RequestError(f"prompt token ids out of vocabulary [0, {self.vocab_size}): {bad[:5]}")
            return list(prompt)
        raise RequestError("prompt must be a string or a list of token ids")
