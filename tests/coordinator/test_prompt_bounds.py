"""Text far longer than max_model_len can hold is refused by its length before it is tokenized: a prompt string, a
chat's contents (before the template renders them) and /tokenize's text (a generous multiple of a prompt's limit,
since /tokenize may count texts no prompt could be). The tiny model's real tokenizer and template."""

from __future__ import annotations

import time

import pytest
from transformers import AutoTokenizer

from coordinator.admission import TOKENIZE_CHARS_FACTOR, Admission
from coordinator.block_manager import BlockManager
from coordinator.prompts import tokenize_reply
from protocol.client_messages import ChatPrompt, Tokenize
from protocol.errors import RequestError
from protocol.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def admission(tiny_tied) -> Admission:
    tokenizer = AutoTokenizer.from_pretrained(tiny_tied)
    return Admission(tokenizer, 1024, len(tokenizer), BlockManager(256, 16))


def test_a_chat_is_bounded_by_its_contents_before_the_template_renders(admission):
    limit = admission.max_prompt_chars
    half = "x" * (limit // 2 + 1)  # two messages, each within the limit, over it together
    chat = ChatPrompt(
        [{"role": "user", "content": half}, {"role": "user", "content": [{"type": "text", "text": half}]}], None
    )
    with pytest.raises(RequestError, match=rf"^messages \({2 * len(half)} characters of content\)"):
        admission.admit(chat, None)
    ids, _ = admission.admit(ChatPrompt([{"role": "user", "content": "hello"}], None), None)
    assert ids


def test_tokenize_is_bounded_by_a_multiple_of_the_prompt_limit(admission):
    limit = TOKENIZE_CHARS_FACTOR * admission.max_prompt_chars
    tok = admission.tokenizer
    t0 = time.monotonic()
    with pytest.raises(RequestError, match=rf"^prompt \({limit + 1} characters\) is over /tokenize's limit"):
        tokenize_reply(tok, 1024, Tokenize(11, "t", None, "ab" * (limit // 2) + "c", True, False), limit)
    assert time.monotonic() - t0 < 10  # refused by its length: no tokenizer ran (a generous bound on a loaded box)
    chat = ChatPrompt([{"role": "user", "content": "y" * (limit + 1)}], None)
    with pytest.raises(RequestError, match=r"^messages \("):
        tokenize_reply(tok, 1024, Tokenize(11, "t", None, chat, True, False), limit)
    # a text longer than any prompt may still be counted
    reply = tokenize_reply(tok, 1024, Tokenize(11, "t", None, "ab " * (limit // 3), True, False), limit)
    assert len(reply.token_ids) > 1024


def test_a_prompt_that_fills_the_context_is_refused_unless_it_is_to_be_truncated(admission):
    text = "ab " * 3000  # within the character limit, over max_model_len (1024) in tokens
    with pytest.raises(RequestError, match=r"^prompt \(\d+ tokens\) leaves no room for output tokens"):
        admission.admit(text, SamplingParams(max_tokens=10))
    ids, _ = admission.admit(text, SamplingParams(max_tokens=10, truncate_prompt_tokens=100))
    assert ids == admission.tokenizer.encode(text)[-100:]
