"""A Hub id not in the cache is downloaded when online: from a Hugging Face Hub on 127.0.0.1 (HF_ENDPOINT,
tests/support/fake_hub.py) through ``launch.py --download-dir``. Only what nanoserve reads is fetched: config,
generation config, tokenizer files and the safetensors weights its index names, never a pickle (*.bin), a
checkpoint's code or a second copy of the weights; the download is then found offline."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from model.tiny import TinySpec, write_tiny_checkpoint
from tests.support.fake_hub import FakeHub
from tests.support.hf_cache import commit_hash, repo_folder
from tests.support.openai_http import ENGINE_ARGS
from tests.support.processes import ROOT
from tests.support.timeouts import HANG_S, START_S

SHARDED, SINGLE = "some-org/sharded", "some-org/single"
COMMIT = commit_hash("remote")
# what a repository may hold besides what nanoserve reads: none of it is fetched
EXTRAS = {"pytorch_model.bin": b"a pickle", "modeling_custom.py": b"raise SystemExit('ran')\n", "README.md": b"# x"}
READ = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub_repos")
    sharded = write_tiny_checkpoint(root / "sharded", TinySpec(max_shard_size="100KB", seed=3))
    single = write_tiny_checkpoint(root / "single", TinySpec(seed=4))
    # a consolidated copy beside the shards (as some repos ship), and one in a subfolder
    shutil.copy(single / "model.safetensors", sharded / "consolidated.safetensors")
    (single / "original").mkdir()
    shutil.copy(single / "model.safetensors", single / "original" / "model.safetensors")
    for repo in (sharded, single):
        for name, data in EXTRAS.items():
            (repo / name).write_bytes(data)
    with FakeHub({SHARDED: (COMMIT, sharded), SINGLE: (COMMIT, single)}) as h:
        yield h


def _env(tmp_path, hub: FakeHub | None) -> dict:
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf_home"), HF_HUB_DISABLE_TELEMETRY="1")
    env.pop("HF_HUB_CACHE", None)
    env.pop("HF_HUB_OFFLINE", None)
    if hub is None:
        env["HF_HUB_OFFLINE"] = "1"
    else:
        env["HF_ENDPOINT"] = hub.endpoint
    return env


def _resolve(env: dict, name: str, download_dir) -> subprocess.CompletedProcess:
    code = f"from coordinator.model_source import resolve; print(resolve({name!r}, '', {str(download_dir)!r}))"
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S
    )


def test_launch_downloads_a_hub_id_into_the_download_dir_and_fetches_only_what_it_reads(hub, tmp_path):
    downloads = tmp_path / "downloads"
    cmd = [sys.executable, "launch.py", *ENGINE_ARGS, "--model", SHARDED, "--download-dir", str(downloads)]
    cmd += ["--prompt", "def hello(", "--max-tokens", "4"]
    out = subprocess.run(cmd, cwd=ROOT, env=_env(tmp_path, hub), capture_output=True, text=True, timeout=START_S)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.startswith("Prompt: 'def hello(', Generated text: ")
    snapshot = repo_folder(downloads, SHARDED) / "snapshots" / COMMIT
    shards = {p.name for p in hub.repos[SHARDED][1].glob("model-*-of-*.safetensors")}  # the index names these
    assert len(shards) > 1
    expected = READ | shards | {"model.safetensors.index.json"}
    assert {p.name for p in snapshot.iterdir()} == expected
    assert hub.fetched() >= expected and not hub.fetched() & {"consolidated.safetensors", *EXTRAS}
    assert not (tmp_path / "hf_home" / "hub").exists()  # --download-dir, not HF_HOME's cache

    # the download is there for the next start, offline (and with the Hub gone)
    again = _resolve(_env(tmp_path, None), SHARDED, downloads)
    assert again.returncode == 0 and again.stdout.strip() == str(snapshot), again.stderr[-4000:]


def test_without_an_index_only_the_top_level_safetensors_are_fetched(hub, tmp_path):
    out = _resolve(_env(tmp_path, hub), SINGLE, "")  # '' = HF_HOME's cache
    assert out.returncode == 0, out.stderr[-4000:]
    snapshot = repo_folder(tmp_path / "hf_home" / "hub", SINGLE) / "snapshots" / COMMIT
    assert out.stdout.strip() == str(snapshot)
    assert {p.name for p in snapshot.iterdir()} == READ | {"model.safetensors"}
    fetched = {f for f in hub.fetched() if f not in READ}
    assert fetched >= {"model.safetensors"} and not fetched & {"original/model.safetensors", *EXTRAS}


def test_an_id_the_hub_does_not_have_is_one_clear_error(hub, tmp_path):
    cmd = [sys.executable, "launch.py", "--port", "0", *ENGINE_ARGS, "--model", "some-org/nowhere"]
    out = subprocess.run(cmd, cwd=ROOT, env=_env(tmp_path, hub), capture_output=True, text=True, timeout=START_S)
    assert out.returncode == 2, out.stderr[-4000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-4000:]
    assert "'some-org/nowhere' could not be fetched from the Hugging Face Hub" in errors[0]
    assert errors[0].endswith("the Hub has no such repository (a private one needs HF_TOKEN)")
