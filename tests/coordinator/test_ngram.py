"""coordinator/ngram.py against a plain-Python reference (every suffix length, every occurrence), and
coordinator/speculative.py's config checks, key by key."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.ngram import known_tokens, propose
from coordinator.sequence import Sequence
from coordinator.speculative import SpecStats, SpeculativeConfig, SpeculativeConfigError
from protocol.sampling_params import SamplingParams


def _reference(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    length = len(tokens)
    for n in range(n_max, n_min - 1, -1):
        if n >= length:
            continue
        suffix = tokens[length - n :]
        starts = [i for i in range(length - n) if tokens[i : i + n] == suffix]
        if starts:
            # the most following tokens (up to k), then the latest occurrence
            best = max(starts, key=lambda i: (min(k, length - (i + n)), i))
            return tokens[best + n : best + n + k]
    return []


def test_matches_the_reference_on_random_and_looping_sequences():
    rng = np.random.default_rng(0)
    for trial in range(400):
        vocab = int(rng.integers(2, 8))
        length = int(rng.integers(1, 40))
        tokens = rng.integers(0, vocab, length).tolist()
        if trial % 3 == 0:  # a loop, as greedy random models fall into
            period = int(rng.integers(1, 6))
            tokens = (tokens[:period] * 20)[:length]
        k, n_min = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        n_max = n_min + int(rng.integers(0, 4))
        got = propose(np.array(tokens, np.int32), k, n_min, n_max).tolist()
        assert got == _reference(tokens, k, n_min, n_max), (tokens, k, n_min, n_max)


def test_longest_suffix_wins_and_too_short_proposes_nothing():
    t = np.array([1, 2, 3, 9, 9, 5, 2, 3, 7, 7, 1, 2, 3], np.int32)
    # suffix [1, 2, 3] occurs at 0 (n = 3); [2, 3] also at 6, but the longer match decides
    assert propose(t, 3, 2, 3).tolist() == [9, 9, 5]
    assert propose(t, 3, 4, 4).tolist() == []  # no 4-gram repeats
    assert propose(np.array([4], np.int32), 3, 1, 1).tolist() == []


def test_a_short_loop_still_proposes_k():
    t = np.array([5, 6, 5, 6, 5, 6], np.int32)
    assert propose(t, 4, 1, 2).tolist() == [5, 6, 5, 6]


def test_config_defaults_and_refusals_by_key():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.disable_by_batch_size) == (5, 5, 8)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    e3 = SpeculativeConfig.from_dict({"method": "eagle3", "model": "some/draft", "num_speculative_tokens": 3})
    assert e3.model == "some/draft"
    bad = [
        ({"method": "ngram", "num_speculative_tokens": 3, "draft_tp": 1}, r"speculative_config\.draft_tp: unknown"),
        ({"method": "medusa", "num_speculative_tokens": 3}, r"speculative_config\.method must be one of"),
        ({"num_speculative_tokens": 3}, r"speculative_config\.method"),
        ({"method": "ngram"}, r"speculative_config\.num_speculative_tokens is required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens must be an integer >= 1"),
        ({"method": "ngram", "num_speculative_tokens": "3"}, r"num_speculative_tokens must be an integer"),
        ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
         r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(2\)"),
        ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0}, r"prompt_lookup_min must be"),
        ({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 0}, r"disable_by_batch_size"),
        ({"method": "ngram", "num_speculative_tokens": 3, "model": "x"}, r"speculative_config\.model: ngram"),
        ({"method": "eagle3", "num_speculative_tokens": 3}, r"speculative_config\.model is required"),
        ([1, 2], r"speculative_config must be a JSON object"),
    ]  # fmt: skip
    for raw, message in bad:
        with pytest.raises(SpeculativeConfigError, match=message):
            SpeculativeConfig.from_dict(raw)


def test_stats_count_acceptance_per_position():
    s = SpecStats()
    s.record(np.array([3, 2]), np.array([2, 0]))
    s.record(np.array([4]), np.array([4]))
    assert s.as_dict(4) == {
        "spec_decode_num_drafts": 3,
        "spec_decode_num_draft_tokens": 9,
        "spec_decode_num_accepted_tokens": 6,
        "spec_decode_num_accepted_tokens_per_pos": [2, 2, 1, 1],
    }


def test_the_known_tokens_mirror_follows_the_sequence():
    rng = np.random.default_rng(2)
    seq = Sequence("r", rng.integers(0, 100, 200).tolist(), 200, SamplingParams(), 0.0)
    for _ in range(300):  # a few new tokens at a time, past the mirror's first capacity and its regrowth
        seq.token_ids += rng.integers(0, 100, int(rng.integers(1, 5))).tolist()
        upto = len(seq.token_ids) - int(rng.integers(0, 2))  # the last may be a placeholder still
        assert known_tokens(seq, upto).tolist() == seq.token_ids[:upto]
