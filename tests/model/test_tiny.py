"""model/tiny.py's embedded default model: the first start says it is writing it, later starts find it."""

from __future__ import annotations

import logging

from model import tiny


def test_first_start_says_it_writes_the_default_model(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    said_before_writing = []
    write = tiny.write_tiny_checkpoint

    def recording(out_dir):
        said_before_writing.append(len(caplog.records))
        return write(out_dir)

    monkeypatch.setattr(tiny, "write_tiny_checkpoint", recording)
    with caplog.at_level(logging.INFO, logger="nanoserve"):
        path = tiny.default_model_dir()
        assert said_before_writing == [1]
        assert [r.getMessage() for r in caplog.records] == [
            f"first start: writing the embedded default model to {path} (once, a few seconds)"
        ]
        assert (path / "model.safetensors").is_file() and [p.name for p in tmp_path.iterdir()] == ["tiny-qwen3"]
        caplog.clear()
        assert tiny.default_model_dir() == path
        assert caplog.records == [] and said_before_writing == [1]
