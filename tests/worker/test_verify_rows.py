"""Verify rows (speculative decoding) on the real model runner, driven by StepCommands as a worker receives them,
with HF transformers (float32, CPU) as the oracle: a row [last token, d drafts] keeps the drafts that are the
target's greedy tokens and adds the target's own, logprobs of every emitted token are the non-speculative ones, and
the slot continues from the accepted tokens only (computed length, the async feed of its last token)."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from kernels.attention import AttentionMetadata
from model.context import forward_context
from protocol.codec import decode, encode
from protocol.messages import StepCommand
from tests.support.builders import i32, make_step, worker_config
from tests.support.processes import ROOT, torchrun_cmd
from tests.support.timeouts import bound
from worker.model_runner import ModelRunner

PROMPT_LEN = 21


@pytest.fixture(scope="module")
def oracle(tiny_untied):
    """The prompts and HF's greedy continuation of each, with the raw log-softmax at every position."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_untied, dtype=torch.float32).eval()
    rng = np.random.default_rng(3)
    out = []
    for n in (PROMPT_LEN, 30, 12, 17):
        ids = rng.integers(0, 500, n).tolist()
        with torch.no_grad():
            for _ in range(8):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            logprobs = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
        out.append((ids[:n], ids[n:], logprobs))
    return out


def runner(model_dir) -> ModelRunner:
    r = ModelRunner(worker_config(model_dir), torch.device("cpu"))
    r.allocate_kv(64)
    return r


def wire(step: StepCommand, draft_counts=None) -> StepCommand:
    step.draft_counts = None if draft_counts is None else i32(draft_counts)
    return decode(encode(step), expect=StepCommand)  # what a worker receives


def start(slot: int, prompt: list[int], **params) -> dict:
    return dict(slot=slot, tokens=prompt, start=0, new_blocks=list(range(slot * 8, slot * 8 + 8)), **params)


def test_greedy_partial_acceptance_then_the_slot_continues_from_the_accepted_tokens(tiny_untied, oracle):
    prompt, greedy, _ = oracle[0]
    r = runner(tiny_untied)
    assert r.execute(wire(make_step([start(0, prompt)]))).tolist() == greedy[:1]
    wrong = (greedy[3] + 1) % 509
    done = r.launch(wire(make_step([dict(slot=0, tokens=[greedy[0], greedy[1], greedy[2], wrong])], 1), [3]))
    assert done.wait().tolist() == greedy[1:4]  # two drafts kept, then the target's own token at the mismatch
    assert done.num_accepted.tolist() == [2]
    # a decode with the async placeholder: fed the last emitted token, at the position after the accepted ones
    nxt = r.launch(wire(make_step([dict(slot=0, tokens=[-1])], 2)))
    assert nxt.wait().tolist() == greedy[4:5] and nxt.num_accepted is None
    assert r.num_computed[0] == PROMPT_LEN + 4


def test_greedy_full_acceptance_adds_the_bonus_token(tiny_untied, oracle):
    prompt, greedy, _ = oracle[0]
    r = runner(tiny_untied)
    r.execute(wire(make_step([start(0, prompt)])))
    done = r.launch(wire(make_step([dict(slot=0, tokens=greedy[:4])], 1), [3]))
    assert done.wait().tolist() == greedy[1:5] and done.num_accepted.tolist() == [3]
    assert r.execute(wire(make_step([dict(slot=0, tokens=[-1])], 2))).tolist() == greedy[5:6]


def test_logprobs_of_every_emitted_token_are_the_non_speculative_ones(tiny_untied, oracle):
    prompt, greedy, ref = oracle[0]
    r = runner(tiny_untied)
    r.execute(wire(make_step([start(0, prompt, logprobs=2)])))
    done = r.launch(wire(make_step([dict(slot=0, tokens=[greedy[0], greedy[1], 7])], 1), [2]))
    assert done.wait().tolist() == greedy[1:3]
    ids, values = done.logprob_token_ids.reshape(2, 3), done.logprobs.reshape(2, 3)
    for j in range(2):  # emitted token j is predicted at position PROMPT_LEN + j
        row = ref[PROMPT_LEN + j]
        top = row.topk(2)
        assert ids[j].tolist() == [greedy[1 + j], *top.indices.tolist()]
        np.testing.assert_allclose(values[j], [row[greedy[1 + j]], *top.values.tolist()], atol=1e-4)


def test_a_mixed_step_of_chunks_verify_rows_and_decodes(tiny_untied, oracle):
    """One step: a prompt chunk that ends inside its prompt (not sampled), a whole prompt, two verify rows (one
    accepts everything, one nothing) and a plain decode; each row gets what it would alone."""
    (p0, g0, _), (p1, g1, _), (p2, g2, _), (p3, g3, _) = oracle
    r = runner(tiny_untied)
    first = [start(0, p0), start(2, p2), start(3, p3)]
    assert r.execute(wire(make_step(first))).tolist() == [g0[0], g2[0], g3[0]]
    r.execute(wire(make_step([dict(slot=3, tokens=[-1])], 1)))  # slot 3 is now at g3[1]
    rows = [
        start(1, p1[:10], sample=False),
        dict(slot=0, tokens=g0[:3]),  # both drafts right: + bonus
        dict(slot=2, tokens=[g2[0], (g2[1] + 5) % 509]),  # its draft wrong
        dict(slot=3, tokens=[-1]),
    ]
    done = r.launch(wire(make_step(rows, 2), [0, 2, 1]))
    assert done.wait().tolist() == [*g0[1:4], g2[1], g3[2]]
    assert done.num_accepted.tolist() == [2, 0, 0]
    rows = [dict(slot=1, tokens=p1[10:]), *[dict(slot=s, tokens=[-1]) for s in (0, 2, 3)]]
    assert r.execute(wire(make_step(rows, 3))).tolist() == [g1[0], g0[4], g2[2], g3[3]]
    assert r.num_computed[[0, 1, 2, 3]].tolist() == [PROMPT_LEN + 4, 30, 12 + 2, 17 + 3]


def test_a_verify_step_replays_the_decode_graph_one_row_per_token(tiny_untied, oracle):
    """Without a prefill chunk, a verify row's tokens are decode rows of their own: each attends up to its own
    position through the sequence's block table, so the step fits a whole-forward decode graph."""
    prompt, greedy, _ = oracle[0]
    r = runner(tiny_untied)
    r.execute(wire(make_step([start(0, prompt)])))
    calls = []

    class Recording:  # stands in for the decode graph: records its rows and runs them eagerly as decode rows
        max_batch = 8

        def run(self, stager, ids, positions, slot_mapping, seq_lens, tables):
            calls.append((positions.copy(), seq_lens.copy(), tables.copy()))
            meta = AttentionMetadata(
                slot_mapping=r.to_dev(slot_mapping),
                num_prefill_tokens=0,
                num_prefills=0,
                num_decodes=len(ids),
                decode_seq_lens=r.to_dev(seq_lens, torch.int32),
                decode_block_tables=r.to_dev(tables, torch.int32),
                max_decode_seq_len=int(seq_lens.max()),
            )
            with forward_context(meta, r.backend):
                return r.model(ids, r.to_dev(positions))

    r.graphs = Recording()
    done = r.launch(wire(make_step([dict(slot=0, tokens=greedy[:3])], 1), [2]))
    assert done.wait().tolist() == greedy[1:4]
    positions, lens, tables = calls[0]
    assert positions.tolist() == [PROMPT_LEN, PROMPT_LEN + 1, PROMPT_LEN + 2]
    assert lens.tolist() == (positions + 1).tolist()
    assert (tables == tables[0]).all() and tables.shape[0] == 3
    # a step with a prefill chunk keeps its verify rows as multi-token rows: no decode graph
    r.execute(wire(make_step([dict(slot=0, tokens=[-1])], 2)))
    done = r.launch(wire(make_step([start(1, oracle[1][0]), dict(slot=0, tokens=greedy[4:6])], 3), [0, 1]))
    assert done.wait().tolist() == [oracle[1][1][0], *greedy[5:7]]
    assert len(calls) == 2  # the plain decode step above, not the mixed one


def test_sampled_verify_rows_emit_1_plus_accepted_tokens_and_a_seed_repeats_them(tiny_untied, oracle):
    prompt, greedy, _ = oracle[0]
    results = []
    for _ in range(2):
        r = runner(tiny_untied)
        r.execute(wire(make_step([start(0, prompt, temperature=1.0, top_k=3, seed=11)])))
        last = int(r.last_tokens[0])
        done = r.launch(wire(make_step([dict(slot=0, tokens=[last, *greedy[1:4]])], 1), [3]))
        tokens, a = done.wait().tolist(), int(done.num_accepted[0])
        assert len(tokens) == 1 + a and tokens[:a] == greedy[1 : 1 + a]
        assert int(r.last_tokens[0]) == tokens[-1]  # the async feed
        r.execute(wire(make_step([dict(slot=0, tokens=[-1])], 2)))
        assert r.num_computed[0] == PROMPT_LEN + 1 + a + 1  # the rejected drafts' positions are computed again
        results.append(tokens)
    assert results[0] == results[1]


def test_tp2_verify_rows_match_hf_and_every_rank_follows_rank_0(tiny_untied, oracle):
    """TP 2 on gloo: the vocabulary is sharded, so the verify rows' logits are gathered to rank 0, which decides;
    the other rank learns the accepted counts (a broadcast), so both hold the same lengths and async feed, also
    after a sampled verify row."""
    (p0, g0, _), (p1, g1, _), (p2, _, _), _ = oracle
    steps = [
        [start(0, p0), start(1, p1), start(2, p2, temperature=1.0, top_k=4)],
        [dict(slot=0, tokens=[*g0[:3], (g0[3] + 1) % 509]), dict(slot=1, tokens=g1[:3]), dict(slot=2, tokens=[-1])],
        [dict(slot=0, tokens=[-1]), dict(slot=1, tokens=[-1]), dict(slot=2, tokens=[-1])],
    ]
    steps[1][2]["tokens"] = [1, 2, 3]  # a sampled verify row: whatever it accepts, both ranks must agree
    case = {"steps": steps, "drafts": [None, [3, 2, 2], None]}
    cmd = torchrun_cmd(2, "tests.worker.tp_verify", "--model", str(tiny_untied), "--case", json.dumps(case))
    out = subprocess.run(cmd, cwd=str(ROOT), capture_output=True, text=True, timeout=bound(600))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    first, verify_step, after = got["steps"]
    assert first["tokens"][:2] == [g0[0], g1[0]] and first["accepted"] is None
    a2 = verify_step["accepted"][2]
    assert verify_step["accepted"][:2] == [2, 2]
    assert verify_step["tokens"][:6] == [*g0[1:4], *g1[1:4]] and len(verify_step["tokens"]) == 7 + a2
    assert after["tokens"][:2] == [g0[4], g1[4]]
    assert got["ranks_agree"]
    assert got["num_computed"] == [PROMPT_LEN + 4, 30 + 4, 12 + 1 + a2 + 1]


@pytest.mark.parametrize("masks_follow", [False, True], ids=["masks_in_step", "masks_follow"])
def test_structured_output_masks_and_logprobs_of_ordinary_rows_beside_a_verify_row(tiny_untied, oracle, masks_follow):
    """The step's mask rows count its sampled rows (the verify row is one); the mask goes to the ordinary row it
    names, also when it arrives after the forward (StepMasks), and that row's logprobs are the only ones."""
    (p0, g0, _), (p1, g1, _), _, _ = oracle
    r = runner(tiny_untied)
    r.execute(wire(make_step([start(0, p0), start(1, p1, logprobs=1)])))
    words = np.zeros(-(-509 // 32), dtype=np.int32)
    words[7 // 32] = 1 << (7 % 32)  # slot 1 may emit token 7 only
    step = make_step([dict(slot=0, tokens=g0[:3]), dict(slot=1, tokens=[-1])], 1)
    step.mask_rows, step.token_masks = i32([1]), None if masks_follow else words
    launched = r.launch(wire(step, [2]))
    done = launched.finish(words) if masks_follow else launched
    assert done.wait().tolist() == [*g0[1:4], 7] and done.num_accepted.tolist() == [2, 0]
    assert done.logprob_token_ids.tolist()[0] == 7 and len(done.logprobs) == 2  # token 7 and the top 1


def test_min_tokens_count_every_emitted_token_of_a_verify_row(tiny_untied, oracle):
    """min_tokens=3 with a stop id that greedy emits fourth: the prompt's token and a verify row's two emitted
    tokens complete it, so the next decode may emit the stop id."""
    prompt, greedy, _ = oracle[0]
    assert greedy[3] not in greedy[:3]
    r = runner(tiny_untied)
    r.execute(wire(make_step([start(0, prompt, min_tokens=3, stop_token_ids=[greedy[3]])])))
    done = r.launch(wire(make_step([dict(slot=0, tokens=[greedy[0], greedy[1], (greedy[2] + 1) % 509])], 1), [2]))
    assert done.wait().tolist() == greedy[1:3]
    assert r.execute(wire(make_step([dict(slot=0, tokens=[-1])], 2))).tolist() == greedy[3:4]


def test_penalties_count_the_tokens_a_verify_row_emitted(tiny_untied, oracle):
    """Negative frequency and presence penalties (repeats favoured): after a verify row whose draft is rejected,
    the next decode's penalties count the token the row emitted, as a run without drafts does."""
    prompt, _, _ = oracle[0]
    penalty = dict(temperature=0.0, frequency_penalty=-2.0, presence_penalty=-2.0)
    plain = runner(tiny_untied)
    want = [*plain.execute(wire(make_step([start(0, prompt, **penalty)]))).tolist()]
    for i in (1, 2):
        want += plain.execute(wire(make_step([dict(slot=0, tokens=[-1])], i))).tolist()
    r = runner(tiny_untied)
    assert r.execute(wire(make_step([start(0, prompt, **penalty)]))).tolist() == want[:1]
    done = r.launch(wire(make_step([dict(slot=0, tokens=[want[0], (want[1] + 1) % 509])], 1), [1]))
    assert done.wait().tolist() == want[1:2] and done.num_accepted.tolist() == [0]
    assert r.execute(wire(make_step([dict(slot=0, tokens=[-1])], 2))).tolist() == want[2:3]
