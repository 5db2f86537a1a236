"""Incremental detokenization: only complete characters are emitted (a multi-byte character split across
tokens waits for its last byte)."""

from __future__ import annotations


def decode_delta(
    tokenizer, ids: list[int], prefix_offset: int, read_offset: int, skip_special_tokens: bool = True
) -> tuple[str, int, int]:
    """New text of ``ids[read_offset:]``, decoded with a little left context so merges and spaces come out
    right. Returns (delta, new_prefix_offset, new_read_offset)."""
    prefix_text = tokenizer.decode(ids[prefix_offset:read_offset], skip_special_tokens=skip_special_tokens)
    full_text = tokenizer.decode(ids[prefix_offset:], skip_special_tokens=skip_special_tokens)
    if full_text.endswith("\ufffd") or len(full_text) < len(prefix_text):
        return "", prefix_offset, read_offset  # an incomplete UTF-8 sequence: wait for more tokens
    return full_text[len(prefix_text) :], read_offset, len(ids)
