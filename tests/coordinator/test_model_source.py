"""coordinator/model_source.py: a model or tokenizer is a local directory, or a Hugging Face Hub id found in a real
cache layout on disk (refs, snapshots, blobs); a name that is neither is refused by name, before any worker starts.
The engine configuration resolves it once, so the workers are told a local directory. (Through launch.py, LLM and
the openai SDK: tests/serving/test_hub_ids.py.)"""

from __future__ import annotations

import shutil

import huggingface_hub.constants
import pytest

from coordinator.config import EngineArgError, EngineConfig
from coordinator.model_source import resolve, served_model_name
from model.config import ModelConfig
from model.tiny import DEFAULT_MODEL_ID
from tests.support.hf_cache import add_snapshot, commit_hash, repo_folder

MAIN, V2 = commit_hash("main"), commit_hash("v2")


@pytest.fixture
def cache(tmp_path, tiny_tied, tiny_untied):
    """some-org/tiny: main is tiny_tied, the tag v2 tiny_untied (509 tokens)."""
    root = tmp_path / "hub"
    add_snapshot(root, "some-org/tiny", tiny_tied, MAIN)
    add_snapshot(root, "some-org/tiny", tiny_untied, V2, refs=("v2",))
    return root


def _config(cache, **kw) -> EngineConfig:
    return EngineConfig(device="cpu", download_dir=str(cache), **kw)


def test_a_hub_id_resolves_to_its_cached_snapshot_and_the_workers_get_that_directory(cache):
    cfg = _config(cache, model="some-org/tiny")
    snapshots = repo_folder(cache, "some-org/tiny") / "snapshots"
    assert cfg.model == str(snapshots / MAIN)
    assert cfg.worker_config(2048).model == str(snapshots / MAIN)
    assert ModelConfig.from_pretrained(cfg.model).vocab_size == 512  # the files behind the symlinks are read


@pytest.mark.parametrize("revision", ["v2", V2])
def test_revision_picks_another_snapshot_by_tag_or_commit(cache, revision):
    cfg = _config(cache, model="some-org/tiny", revision=revision)
    assert cfg.model == str(repo_folder(cache, "some-org/tiny") / "snapshots" / V2)
    assert ModelConfig.from_pretrained(cfg.model).vocab_size == 509


def test_a_hub_tokenizer_resolves_with_its_own_revision(cache, tiny_tied):
    cfg = _config(cache, model=str(tiny_tied), tokenizer="some-org/tiny", tokenizer_revision="v2")
    assert cfg.model == str(tiny_tied)  # a local directory is taken as it is
    assert cfg.tokenizer == str(repo_folder(cache, "some-org/tiny") / "snapshots" / V2)


def test_a_file_is_refused_as_a_file(tiny_tied):
    weights = tiny_tied / "model.safetensors"
    with pytest.raises(EngineArgError, match=f"model: '{weights}' is a file, not a directory") as e:
        EngineConfig(device="cpu", model=str(weights))
    assert e.value.name == "model"


@pytest.mark.parametrize("name", ["no/such/dir", "./missing-model", "/abs/missing"])
def test_neither_a_directory_nor_a_hub_id_is_refused_at_once(name):
    with pytest.raises(EngineArgError, match=f"model: no directory '{name}', and it is not a Hugging Face Hub id"):
        EngineConfig(device="cpu", model=name)


def test_offline_and_not_cached_names_the_id_and_the_cache(cache, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(EngineArgError) as e:
        _config(cache, model="some-org/absent")
    assert e.value.name == "model"
    assert f"'some-org/absent' is not in the Hugging Face cache {cache}" in str(e.value)
    assert "HF_HUB_OFFLINE is set" in str(e.value)
    with pytest.raises(EngineArgError, match="'some-org/tiny' at revision 'v3' is not in the Hugging Face cache"):
        _config(cache, model="some-org/tiny", revision="v3")


def test_offline_a_snapshot_without_weights_says_what_it_lacks(cache, monkeypatch):
    """An interrupted download: config.json is cached, the weights are not."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    snapshot = repo_folder(cache, "some-org/tiny") / "snapshots" / MAIN
    (snapshot / "model.safetensors").unlink()
    with pytest.raises(
        EngineArgError,
        match=r"the snapshot of 'some-org/tiny' in the Hugging Face cache .* lacks \*\.safetensors weights",
    ):
        _config(cache, model="some-org/tiny")
    assert resolve("some-org/tiny", "", str(cache), "tokenizer") == str(snapshot)  # a tokenizer needs no weights


def test_offline_a_sharded_snapshot_missing_a_shard_names_it(tmp_path, tiny_tied, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    from model.tiny import TinySpec, write_tiny_checkpoint

    sharded = write_tiny_checkpoint(tmp_path / "sharded", TinySpec(max_shard_size="100KB"))
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 1
    (sharded / shards[-1]).unlink()
    add_snapshot(tmp_path / "hub", "some-org/sharded", sharded, MAIN)
    with pytest.raises(EngineArgError, match=f"lacks {shards[-1]} \\(named in model.safetensors.index.json\\)"):
        EngineConfig(device="cpu", model="some-org/sharded", download_dir=str(tmp_path / "hub"))


def test_a_local_directory_wins_over_the_cache(cache, tmp_path, tiny_untied, monkeypatch):
    """A directory named like a Hub id (org/name, relative to the working directory) is the directory."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_untied, tmp_path / "some-org" / "tiny")
    assert _config(cache, model="some-org/tiny").model == "some-org/tiny"


def test_the_served_name_is_the_model_as_given_or_the_embedded_models_short_id():
    assert served_model_name("some-org/tiny") == "some-org/tiny"
    assert served_model_name("./models/x") == "./models/x"
    assert served_model_name("") == DEFAULT_MODEL_ID and "/" not in DEFAULT_MODEL_ID  # a name, not a path
