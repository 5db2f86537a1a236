"""--speculative-config through the server: ``python launch.py`` with the flag serves the same greedy text as
without (streamed too: a verify row's run of tokens arrives as one delta), /metrics carries vLLM's spec-decode
counters under nanoserve:, and a bad config is refused by the flag before anything starts."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import httpx

from model.tiny import write_tiny_checkpoint
from tests.model.test_families import FAMILIES
from tests.support.openai_http import HttpServer, http_post, metric
from tests.support.processes import ROOT
from tests.support.timeouts import HANG_S, START_S

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _text(server: HttpServer, prompt: list[int], stream: bool) -> str:
    body = {"model": "m", "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    if not stream:
        return http_post(server.base_url + "/completions", json=body).json()["choices"][0]["text"]
    text = ""
    with httpx.Client(timeout=HANG_S) as client:
        with client.stream("POST", server.base_url + "/completions", json={**body, "stream": True}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
    return text


def test_server_with_speculation_serves_the_same_text_and_counts_drafts(tmp_path):
    model_dir = write_tiny_checkpoint(tmp_path / "m", dataclasses.replace(FAMILIES["llama"], std=0.02))
    prompts = [[5, 77, 301, 12], [400, 3, 3, 250, 18, 91]]
    names = ("--served-model-name", "m")
    with HttpServer(model_dir, tmp_path / "plain.log", *names) as server:
        want = [_text(server, p, False) for p in prompts]
    flag = ("--speculative-config", json.dumps(SPEC))
    with HttpServer(model_dir, tmp_path / "spec.log", *names, *flag) as server:
        assert [_text(server, p, False) for p in prompts] == want
        assert [_text(server, p, True) for p in prompts] == want
        drafts = metric(server, "nanoserve:spec_decode_num_drafts_total")
        draft_tokens = metric(server, "nanoserve:spec_decode_num_draft_tokens_total")
        accepted = metric(server, "nanoserve:spec_decode_num_accepted_tokens_total")
        per_pos = [
            metric(server, "nanoserve:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(3)
        ]
    assert 0 < accepted <= draft_tokens <= 3 * drafts
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)


def test_bad_config_refused_by_the_flag(tiny_tied):
    bad = json.dumps({**SPEC, "prompt_lookup_min": 9})
    cmd = [sys.executable, str(ROOT / "launch.py"), "--port", "0", "--model", str(tiny_tied)]  # 0: never taken
    out = subprocess.run([*cmd, "--speculative-config", bad], cwd=ROOT, capture_output=True, text=True, timeout=START_S)
    assert out.returncode == 2
    assert (
        "--speculative-config" in out.stderr and "prompt_lookup_min (9) must be <= prompt_lookup_max (3)" in out.stderr
    )


def test_server_with_eagle3_drafts(tmp_path):
    """--speculative-config '{"method": "eagle3", "model": DIR, ...}': the workers' drafts (a copy draft on a repeating
    target, tests/support/tiny_eagle3.py) serve the text of a plain engine, and are counted; a draft that is no draft
    is refused by the flag before anything starts."""
    from model.tiny import TinySpec
    from nanoserve import LLM, SamplingParams
    from tests.support.tiny_eagle3 import DraftSpec, write_tiny_eagle3

    target = write_tiny_checkpoint(
        tmp_path / "t", TinySpec(tie_word_embeddings=True, seed=1, std=0.02, num_hidden_layers=4)
    )
    draft = write_tiny_eagle3(tmp_path / "d", target, DraftSpec(copy=True, aux_layer_ids=[0, 2, 3]))
    prompts = [[5, 77, 301, 12], [400, 3, 3, 250, 18, 91]]
    with LLM(str(target), max_model_len=256) as llm:
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        want = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    eagle = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3}
    flag = ("--speculative-config", json.dumps(eagle))
    with HttpServer(target, tmp_path / "spec.log", "--served-model-name", "m", *flag) as server:
        assert [_text(server, p, False) for p in prompts] == want
        assert [_text(server, p, True) for p in prompts] == want
        accepted = metric(server, "nanoserve:spec_decode_num_accepted_tokens_total")
    assert accepted > 0
    cmd = [sys.executable, str(ROOT / "launch.py"), "--port", "0", "--model", str(target)]  # 0: never taken
    bad = json.dumps({**eagle, "model": str(target)})
    out = subprocess.run([*cmd, "--speculative-config", bad], cwd=ROOT, capture_output=True, text=True, timeout=START_S)
    assert out.returncode == 2 and "--speculative-config" in out.stderr and "is not an EAGLE-3 draft" in out.stderr
