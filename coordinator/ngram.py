"""The n-gram (prompt-lookup) proposer: a sequence's draft is what followed an earlier occurrence of its own last
n tokens (prompt and outputs alike), for the longest n in [prompt_lookup_max .. prompt_lookup_min] that occurs.

Each sequence costs a few numpy calls over its tokens, no Python loop over tokens: the positions holding its last
token are found in one compare, and the match length behind every such position in one gather."""

from __future__ import annotations

import numpy as np

_EMPTY = np.zeros(0, np.int32)


def propose(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> np.ndarray:
    """Up to ``k`` draft tokens for ``tokens`` (int array, all known), or an empty array.

    Of the earlier occurrences of the longest suffix found, the one followed by the most tokens (up to k) is taken,
    the latest among those: the latest copy tracks the text's current state (an edited line, the current turn of a
    loop), and preferring a full-length continuation keeps a short loop (period < k) from proposing fewer than k."""
    length = len(tokens)
    if k <= 0 or length < n_min + 1:
        return _EMPTY
    # candidate occurrences: positions e < length - 1 holding the last token (e is where a match ends)
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    if len(ends) == 0:
        return _EMPTY
    back = np.arange(n_max)
    idx = ends[:, None] - back  # [m, n_max]: the tokens before each candidate end, newest first
    valid = idx >= 0
    same = valid & (tokens[np.maximum(idx, 0)] == tokens[length - 1 - back]) & (length - 1 - back >= 0)
    matched = np.cumprod(same, axis=1).sum(axis=1)  # suffix length matched behind each end, capped at n_max
    best = int(matched.max())
    if best < n_min:
        return _EMPTY
    ends = ends[matched == best]
    follow = np.minimum(k, length - 1 - ends)  # tokens after the occurrence (the suffix itself may be among them)
    pick = int(np.argmax(follow * length + ends))  # most following tokens, then latest
    start = int(ends[pick]) + 1
    return tokens[start : start + int(follow[pick])].astype(np.int32, copy=False)


def propose_batch(arrays: list[np.ndarray], caps: list[int], n_min: int, n_max: int) -> list[np.ndarray]:
    """``propose`` for each sequence (its known tokens, its cap on drafts)."""
    return [propose(t, cap, n_min, n_max) for t, cap in zip(arrays, caps)]


def known_tokens(seq, upto: int) -> np.ndarray:
    """The sequence's first ``upto`` tokens (all known) as an int32 array: a mirror kept on the sequence and grown
    by the new tokens only, since a known token never changes (converting the whole list each step costs ~0.2 ms at
    8k tokens)."""
    buf, synced = seq.spec_tokens, seq.spec_synced
    if buf is None or len(buf) < upto:
        grown = np.empty(max(2 * upto, 256), np.int32)
        if buf is not None:
            grown[:synced] = buf[:synced]
        seq.spec_tokens = buf = grown
    if synced < upto:
        buf[synced:upto] = seq.token_ids[synced:upto]
        seq.spec_synced = upto
    return buf[:upto]
