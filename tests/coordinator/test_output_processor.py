"""The output processor on its own, with the tiny checkpoint's real byte-level BPE tokenizer: tokens are fed as the
engine feeds them (appended to the sequence, then ``update``), and the outputs are checked against whole decodes."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from coordinator.output_processor import OutputProcessor
from coordinator.sequence import Sequence
from protocol.sampling_params import SamplingParams

PROMPT = [5, 6, 7]
TEXT = "Hello world! The quick brown fox jumps over the lazy dog."
MULTIBYTE = "你好，世界。 🙂 Ünïcödé ✓"


@pytest.fixture(scope="module")
def tok(tiny_tied):
    return AutoTokenizer.from_pretrained(tiny_tied)


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def run(tok, tokens: list[int], stream: bool, end=("length", None), token_logprobs=None, **params):
    """Feed ``tokens`` one per step (the last one with the token-level stop ``end``: max_tokens unless told);
    returns the outputs, the sequence and the processor."""
    proc = OutputProcessor(tok)
    seq = Sequence("r", list(PROMPT), len(PROMPT), SamplingParams(max_tokens=len(tokens), **params), 0.0)
    every_token = proc.add(seq, stream)
    outs = []
    for i, t in enumerate(tokens):
        seq.token_ids.append(t)
        stop = end if i == len(tokens) - 1 else None
        if stop is None and not every_token:
            continue  # what the engine does: such a request only needs its last token
        out = proc.update(seq, t, None if token_logprobs is None else token_logprobs[i], stop)
        if out is not None:
            outs.append(out)
            if out.finished:
                break
    return outs, seq, proc


def streamed(outs) -> str:
    return "".join(o.text for o in outs)


def stop_across_tokens(tok, ids: list[int]) -> tuple[str, int, int]:
    """A 2-character stop string whose first occurrence straddles tokens k-1 and k: (stop, char index, k)."""
    full = tok.decode(ids)
    for k in range(2, len(ids) - 1):
        head = tok.decode(ids[:k])
        stop = full[len(head) - 1 : len(head) + 1]
        if full.startswith(head) and stop.strip() == stop and len(stop) == 2 and full.find(stop) == len(head) - 1:
            return stop, len(head) - 1, k
    pytest.fail("no stop string across a token boundary")


# ---- stop strings --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_split_across_tokens(tok, stream):
    ids = encode(tok, TEXT)
    stop, idx, k = stop_across_tokens(tok, ids)
    assert stop not in tok.decode(ids[:k]) and stop in tok.decode(ids[: k + 1])  # the case is what it claims
    outs, seq, proc = run(tok, ids, stream, stop=["\x00never", stop])
    last = outs[-1]
    assert last.finish_reason == "stop" and last.stop_reason == stop
    assert last.prompt_token_ids == PROMPT and not proc.states
    if stream:
        assert len(outs) == k + 1 and [t for o in outs for t in o.token_ids] == ids[: k + 1]
        assert streamed(outs) == TEXT[:idx]
        assert all(o.finish_reason is None for o in outs[:-1])
    else:
        assert len(outs) == 1 and last.token_ids == ids[: k + 1] and last.text == TEXT[:idx]


def test_streamed_text_holds_back_what_may_become_a_stop_string(tok):
    ids = encode(tok, TEXT)
    stop = "lazy cat"  # never completes: "lazy " is held back until the "d" of "dog" rules it out
    outs, _, _ = run(tok, ids, stream=True, stop=[stop])
    shown = ""
    for j, out in enumerate(outs[:-1]):
        shown += out.text
        decoded = tok.decode(ids[: j + 1])
        assert decoded.startswith(shown) and len(decoded) - len(shown) >= min(len(stop) - 1, len(decoded))
        assert len(shown) == max(len(decoded) - (len(stop) - 1), 0)  # nothing more is held back than needed
    assert outs[-1].finish_reason == "length" and streamed(outs) == TEXT  # the end flushes the rest


def test_stop_string_in_output_when_asked(tok):
    ids = encode(tok, TEXT)
    stop = "brown"
    idx = TEXT.index(stop)
    outs, _, _ = run(tok, ids, stream=True, stop=[stop], include_stop_str_in_output=True)
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
    assert streamed(outs) == TEXT[: idx + len(stop)]
    shown = ""
    for j, out in enumerate(outs[:-1]):  # kept in the output, a stop string needs no hold-back
        shown += out.text
        assert shown == tok.decode(ids[: j + 1])
    (out,), _, _ = run(tok, ids, stream=False, stop=[stop], include_stop_str_in_output=True)
    assert out.text == TEXT[: idx + len(stop)]
    (out,), _, _ = run(tok, ids, stream=False, stop=[stop])
    assert out.text == TEXT[:idx]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_never_match_within_the_first_min_tokens_tokens(tok, stream):
    """vLLM's: a match must end after the text of the first min_tokens tokens (one may start before it)."""
    ids = encode(tok, TEXT)
    done_at = next(j for j in range(len(ids)) if "brown" in tok.decode(ids[: j + 1]))
    shielded = len(tok.decode(ids[: done_at + 1]))  # "Hello world! The quick brown": its "o"s do not count
    outs, _, _ = run(tok, ids, stream, stop=["o"], min_tokens=done_at + 1)
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", "o")
    assert (streamed(outs) if stream else outs[-1].text) == TEXT[: TEXT.index("o", shielded)]  # " f" of "fox"
    if stream:  # the shielded text is streamed as it comes: no stop string can cut it any more
        assert streamed(outs[:done_at]) == tok.decode(ids[:done_at])
    outs, _, _ = run(tok, ids, stream, stop=["quick"], min_tokens=done_at + 1)
    assert outs[-1].finish_reason == "length" and (streamed(outs) if stream else outs[-1].text) == TEXT
    stop, idx, k = stop_across_tokens(tok, ids)  # starts in token k-1's text, ends in token k's
    outs, _, _ = run(tok, ids, stream, stop=[stop], min_tokens=k)
    assert outs[-1].stop_reason == stop and (streamed(outs) if stream else outs[-1].text) == TEXT[:idx]


def test_stop_ids_win_over_stop_strings_and_stop_strings_over_length(tok):
    ids = encode(tok, TEXT)
    stop, idx, k = stop_across_tokens(tok, ids)
    proc = OutputProcessor(tok)
    seq = Sequence("r", list(PROMPT), len(PROMPT), SamplingParams(max_tokens=k + 1, stop=[stop]), 0.0)
    proc.add(seq, stream=False)
    for t in ids[:k]:
        seq.token_ids.append(t)
        assert proc.update(seq, t, None, None) is None
    seq.token_ids.append(ids[k])
    out = proc.update(seq, ids[k], None, ("length", None))  # the last allowed token completes the stop string
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", stop, TEXT[:idx])
    outs, _, _ = run(tok, ids[: k + 1], stream=False, end=None, stop=[stop])
    assert outs[-1].finish_reason == "stop"
    proc = OutputProcessor(tok)
    seq = Sequence("r", list(PROMPT), len(PROMPT), SamplingParams(stop=[stop], stop_token_ids=[ids[k]]), 0.0)
    proc.add(seq, stream=False)
    for t in ids[:k]:
        seq.token_ids.append(t)
        proc.update(seq, t, None, None)
    seq.token_ids.append(ids[k])
    out = proc.update(seq, ids[k], None, ("stop", ids[k]))
    assert (out.finish_reason, out.stop_reason) == ("stop", ids[k])
    assert out.text == tok.decode(ids[:k])  # a stop id ends it, its text left out (so the stop string is not in it)


# ---- stop tokens ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("eos", [False, True])
@pytest.mark.parametrize("extra", [{}, {"stop": ["\x00never"]}, {"logprobs": 1}])
def test_stop_token_text_is_left_out_unless_asked(tok, stream, eos, extra):
    """vLLM's: a request that ends on EOS or a stop id keeps the id (and its logprobs) but not its text."""
    ids = encode(tok, TEXT)[:8]
    last = tok.convert_tokens_to_ids("<|endoftext|>") if eos else ids[-1]
    ids[-1] = last
    end = ("stop", None) if eos else ("stop", last)
    lps = [{t: -0.5, 1: -9.0} for t in ids] if "logprobs" in extra else None
    for keep in (False, True):
        params = dict(extra, skip_special_tokens=False, include_stop_str_in_output=keep)
        outs, _, proc = run(tok, ids, stream, end=end, token_logprobs=lps, **params)
        assert (outs[-1].finish_reason, outs[-1].stop_reason) == end and not proc.states
        assert [t for o in outs for t in o.token_ids] == ids
        if lps is not None:
            assert [lp for o in outs for lp in o.logprobs] == lps
        text = streamed(outs) if stream else outs[-1].text
        assert text == tok.decode(ids if keep else ids[:-1], skip_special_tokens=False)
        if stream and not keep and "stop" not in extra:  # (a stop string's hold-back is flushed at the end)
            assert outs[-1].text == ""  # the last delta carries no text of the stop token


# ---- special tokens, multi-byte characters, logprobs, abort --------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_special_tokens_in_text_only_when_asked(tok, stream):
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    ids = encode(tok, "Hello") + [eos] + encode(tok, " world")
    outs, _, _ = run(tok, ids, stream)
    assert (streamed(outs) if stream else outs[-1].text) == "Hello world"
    outs, _, _ = run(tok, ids, stream, skip_special_tokens=False)
    assert (streamed(outs) if stream else outs[-1].text) == "Hello<|endoftext|> world"
    # a stop string made of a special token's text matches only where that text is in the output
    outs, _, _ = run(tok, ids, stream, skip_special_tokens=False, stop=["<|endoftext|>"])
    assert outs[-1].finish_reason == "stop" and (streamed(outs) if stream else outs[-1].text) == "Hello"
    outs, _, _ = run(tok, ids, stream, stop=["<|endoftext|>"])
    assert outs[-1].finish_reason == "length"


def test_multibyte_characters_are_never_split(tok):
    ids = encode(tok, MULTIBYTE)
    assert any("\ufffd" in tok.decode(ids[: j + 1]) for j in range(len(ids)))  # tokens do split characters
    outs, _, _ = run(tok, ids, stream=True)
    assert all("\ufffd" not in o.text for o in outs)
    assert streamed(outs) == MULTIBYTE
    assert any(o.text == "" for o in outs[:-1])  # some steps had only part of a character to show
    outs, _, _ = run(tok, ids, stream=True, stop=["世界"])
    assert streamed(outs) == MULTIBYTE[: MULTIBYTE.index("世界")] and outs[-1].stop_reason == "世界"


def test_logprobs_per_token(tok):
    ids = encode(tok, TEXT)[:6]
    lps = [{t: -0.5 * i, 1: -9.0} for i, t in enumerate(ids)]
    (out,), _, _ = run(tok, ids, stream=False, token_logprobs=lps, logprobs=1)
    assert out.logprobs == lps and out.token_ids == ids
    outs, _, _ = run(tok, ids, stream=True, token_logprobs=lps, logprobs=1)
    assert [o.logprobs for o in outs] == [[lp] for lp in lps]
    outs, _, _ = run(tok, ids, stream=True)
    assert all(o.logprobs is None for o in outs)


def test_abort_flushes_held_back_text(tok):
    ids = encode(tok, TEXT)[:10]
    for stream in (True, False):
        proc = OutputProcessor(tok)
        seq = Sequence("r", list(PROMPT), len(PROMPT), SamplingParams(max_tokens=64, stop=["zzzzzz"]), 0.0)
        proc.add(seq, stream)
        outs = []
        for t in ids:
            seq.token_ids.append(t)
            outs += [o for o in [proc.update(seq, t, None, None)] if o is not None]
        last = proc.finish(seq, "abort")
        assert last.finish_reason == "abort" and last.stop_reason is None and not proc.states
        if stream:
            assert last.token_ids == [] and streamed(outs) + last.text == tok.decode(ids)
            assert last.text  # the held-back tail came out at the end
        else:
            assert not outs and last.token_ids == ids and last.text == tok.decode(ids)
        assert proc.finish(seq, "abort") is None  # once
