"""model/tiny.py: the embedded default model ships in the package (nothing is written at start, a missing one is
named), and random checkpoints of odd shapes are still written for the tests."""

from __future__ import annotations

import json

import pytest

from model import tiny


def test_the_default_model_is_read_from_the_package_and_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    path = tiny.default_model_dir()
    assert path == tiny.DEFAULT_MODEL_DIR and (path / "model.safetensors").is_file()
    assert list(tmp_path.iterdir()) == []


def test_a_missing_default_model_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(tiny, "DEFAULT_MODEL_DIR", tmp_path / "default_model")
    with pytest.raises(FileNotFoundError, match="embedded default model is missing from .*default_model"):
        tiny.default_model_dir()


def test_a_random_checkpoint_of_an_odd_shape(tmp_path):
    spec = tiny.TinySpec(vocab_size=509, num_hidden_layers=3, tie_word_embeddings=False)
    path = tiny.write_tiny_checkpoint(tmp_path / "odd", spec)
    config = json.loads((path / "config.json").read_text())
    assert (config["vocab_size"], config["num_hidden_layers"], config["tie_word_embeddings"]) == (509, 3, False)
