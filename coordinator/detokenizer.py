"""Incremental detokenization: only complete characters are emitted (a multi-byte character split across
tokens waits for its last byte); and each token id's own text, for logprob entries."""

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


class TokenTexts:
    """Each token id's own text, special tokens kept, as a logprob entry names the token it is about: decoded once
    per id, in one batch for the ids not seen before."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.texts: dict[int, str] = {}

    def of(self, ids) -> dict[int, str]:
        """The id -> text map, holding every id of ``ids``."""
        missing = [t for t in dict.fromkeys(ids) if t not in self.texts]
        if missing:
            self.texts.update(
                zip(missing, self.tokenizer.batch_decode([[t] for t in missing], skip_special_tokens=False))
            )
        return self.texts
