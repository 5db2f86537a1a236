"""Hugging Face Hub ids through the real entry points, offline (HF_HUB_OFFLINE=1), from a real cache layout on disk
under HF_HOME (refs, snapshots, blobs; tests/support/hf_cache.py): ``launch.py --model some-org/tiny`` served over
HTTP and named by that id in the openai SDK, ``LLM("some-org/tiny", revision=...)``, the error of an id that is not
cached, ``trust_remote_code`` (accepted; a checkpoint's own code never runs), and the embedded model's short id."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import openai
import pytest

from model.tiny import DEFAULT_MODEL_ID
from tests.support.hf_cache import add_snapshot, commit_hash, repo_folder
from tests.support.hf_oracle import Oracle
from tests.support.openai_http import ENGINE_ARGS, HttpServer
from tests.support.processes import ROOT
from tests.support.timeouts import HANG_S, START_S

REPO = "some-org/tiny"
MAIN, V2 = commit_hash("main"), commit_hash("v2")
GREEDY = dict(temperature=0, max_tokens=8, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, tiny_tied, tiny_untied):
    """HF_HOME whose hub cache holds some-org/tiny: main is tiny_tied, the tag v2 tiny_untied."""
    home = tmp_path_factory.mktemp("hf_home")
    add_snapshot(home / "hub", REPO, tiny_tied, MAIN)
    add_snapshot(home / "hub", REPO, tiny_untied, V2, refs=("v2",))
    return home


@pytest.fixture(scope="module")
def offline_env(hf_home):
    """The environment of the processes under test: HF_HOME names the cache, and nothing may be downloaded."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HOME", str(hf_home))
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.delenv("HF_HUB_CACHE", raising=False)
        yield dict(os.environ)


def _api(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=HANG_S)


@pytest.fixture(scope="module")
def hub_server(offline_env, tmp_path_factory):
    with HttpServer(REPO, tmp_path_factory.mktemp("hub") / "server.log") as srv:
        yield srv


def test_launch_serves_a_hub_id_from_the_cache_named_by_that_id(hub_server, hf_home, tiny_tied):
    api = _api(hub_server)
    assert [m.id for m in api.models.list().data] == [REPO]  # --model as given, not the snapshot's path
    card = api.models.retrieve(REPO)
    assert (card.id, card.object, card.owned_by) == (REPO, "model", "nanoserve")
    # the workers loaded the snapshot of refs/main, through its symlinks into blobs/
    assert card.root == str(repo_folder(hf_home / "hub", REPO) / "snapshots" / MAIN)
    r = api.completions.create(model=REPO, prompt="def hello(", **GREEDY)
    hf = Oracle(tiny_tied)
    assert r.model == REPO and r.choices[0].text == hf.text(hf.greedy(hf.ids("def hello("), 8))


@pytest.mark.parametrize("name", ["some-org/other", "tiny", "/a/path/tiny"])
def test_retrieving_a_model_not_served_is_an_openai_404(hub_server, name):
    with pytest.raises(openai.NotFoundError) as e:
        _api(hub_server).models.retrieve(name)
    assert e.value.status_code == 404
    assert e.value.body == {
        "message": f"The model `{name}` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }


def test_llm_resolves_a_hub_id_at_a_revision(offline_env, hf_home):
    """LLM(...) in a process of its own: HF_HOME and HF_HUB_OFFLINE are read when huggingface_hub is imported."""
    script = (
        "import json; from nanoserve import LLM, SamplingParams\n"
        "kw = dict(device='cpu', dtype='float32', num_kv_blocks=64, trust_remote_code=True)\n"
        f"with LLM({REPO!r}, revision='v2', **kw) as llm:\n"
        "    out = llm.generate(['def hello('], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)\n"
        "    print(json.dumps([llm.engine.config.model, llm.engine.vocab_size, len(out[0].outputs[0].token_ids)]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=offline_env, capture_output=True, text=True, timeout=START_S
    )
    assert out.returncode == 0, out.stderr[-4000:]
    model, vocab, generated = json.loads(out.stdout.strip().splitlines()[-1])
    assert model == str(repo_folder(hf_home / "hub", REPO) / "snapshots" / V2)
    assert (vocab, generated) == (509, 4)  # tiny_untied's vocabulary: the v2 snapshot was loaded


def _launch(env, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "launch.py", "--port", "0", *ENGINE_ARGS, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=START_S)


def test_an_id_not_cached_offline_is_one_clear_error(offline_env, hf_home):
    out = _launch(offline_env, "--model", "some-org/absent")
    assert out.returncode == 2, out.stderr[-4000:]
    error = [line for line in out.stderr.splitlines() if "error" in line.lower()]
    assert len(error) == 1, out.stderr
    assert error[0].startswith("error: argument --model: ")
    assert f"'some-org/absent' is not in the Hugging Face cache {hf_home / 'hub'}" in error[0]
    assert "HF_HUB_OFFLINE is set" in error[0]
    assert "Traceback" not in out.stderr


def test_trust_remote_code_is_accepted_but_a_checkpoints_code_never_runs(offline_env, hf_home, tiny_tied, tmp_path):
    """A checkpoint of an architecture nanoserve does not implement, shipping its own modeling code (auto_map): it
    is refused by the architecture's name, with --trust-remote-code too, and its code is never imported."""
    custom = tmp_path / "custom"
    custom.mkdir()
    for f in tiny_tied.iterdir():
        (custom / f.name).write_bytes(f.read_bytes())
    marker = tmp_path / "the checkpoint's code ran"
    (custom / "modeling_custom.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    config = json.loads((custom / "config.json").read_text())
    config.update(architectures=["CustomForCausalLM"], auto_map={"AutoModelForCausalLM": "modeling_custom.Custom"})
    (custom / "config.json").write_text(json.dumps(config))
    add_snapshot(hf_home / "hub", "some-org/custom", custom, MAIN)

    out = _launch(offline_env, "--model", "some-org/custom", "--trust-remote-code")
    assert out.returncode != 0 and "unrecognized arguments" not in out.stderr, out.stderr[-4000:]
    assert "unsupported architecture 'CustomForCausalLM'" in out.stderr, out.stderr[-4000:]
    assert not marker.exists()


@pytest.fixture(scope="module")
def embedded_server(tmp_path_factory):
    """The embedded default model (--model '' is no --model: the engine's default)."""
    with HttpServer("", tmp_path_factory.mktemp("embedded") / "server.log") as srv:
        yield srv


def test_the_embedded_model_is_served_under_its_short_id(embedded_server):
    api = _api(embedded_server)
    assert [m.id for m in api.models.list().data] == [DEFAULT_MODEL_ID]
    assert api.models.retrieve(DEFAULT_MODEL_ID).id == DEFAULT_MODEL_ID
    r = api.completions.create(model=DEFAULT_MODEL_ID, prompt="def fibonacci(n):", **GREEDY)
    assert r.model == DEFAULT_MODEL_ID and r.usage.completion_tokens == 8
    chat = api.chat.completions.create(
        model=DEFAULT_MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.model == DEFAULT_MODEL_ID
