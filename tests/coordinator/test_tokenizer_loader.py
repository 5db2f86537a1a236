"""coordinator/tokenizer_loader.py: the embedded default model's tokenizer is built by its class directly, and is the
same tokenizer AutoTokenizer builds (class, settings, vocabulary, encodings, chat prompts); it loads without
transformers' auto classes (the start-up time it saves). Any other directory goes through AutoTokenizer once; a
later start builds the class AutoTokenizer chose, without its import, and gets the same tokenizer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from transformers import AutoTokenizer

from coordinator.tokenizer_loader import is_embedded_model, load_tokenizer, tokenizer_class
from model.tiny import DEFAULT_MODEL_DIR
from tests.support.timeouts import START_S
from tests.support.transformers_torch import tokenizer_import_loads_torch

TEXT = 'def fib(n):\n    """The n-th number."""\n    return n if n < 2 else fib(n - 1) + 7\n\t<|im_end|>é'
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


def _same(a, b) -> None:
    assert type(a) is type(b)
    assert a.init_kwargs == b.init_kwargs
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert a.get_vocab() == b.get_vocab()
    assert a.all_special_ids == b.all_special_ids and a.eos_token_id == b.eos_token_id
    ids = a.encode(TEXT)
    assert ids == b.encode(TEXT)
    assert a.decode(ids) == b.decode(ids) and a.decode(ids, skip_special_tokens=True) == b.decode(
        ids, skip_special_tokens=True
    )
    assert a.convert_ids_to_tokens(ids) == b.convert_ids_to_tokens(ids)
    assert a.chat_template == b.chat_template
    assert a.chat_template is None or a.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True
    ) == b.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)


def test_the_embedded_models_tokenizer_is_the_one_autotokenizer_builds():
    assert tokenizer_class("") is tokenizer_class(DEFAULT_MODEL_DIR) is not AutoTokenizer  # "": the engine's default
    assert is_embedded_model(DEFAULT_MODEL_DIR) and is_embedded_model(str(DEFAULT_MODEL_DIR / ".." / "default_model"))
    _same(load_tokenizer(str(DEFAULT_MODEL_DIR)), AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR)))


def test_another_directory_goes_through_autotokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "cache"))
    copy = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL_DIR, copy)
    assert not is_embedded_model(copy) and not is_embedded_model(tmp_path / "missing")
    assert tokenizer_class(copy) is AutoTokenizer
    _same(load_tokenizer(str(copy)), AutoTokenizer.from_pretrained(str(copy)))


def test_the_embedded_models_tokenizer_loads_without_transformers_auto_classes():
    code = (
        "import sys; from coordinator.tokenizer_loader import load_tokenizer; from model.tiny import DEFAULT_MODEL_DIR;"
        "load_tokenizer(DEFAULT_MODEL_DIR);"
        "print(sorted(m for m in ('transformers.models.auto.tokenization_auto', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=START_S, check=True)
    expected = "['torch']" if tokenizer_import_loads_torch() else "[]"  # 5.17's own tokenizer import loads torch
    assert out.stdout.strip() == expected, out.stdout + out.stderr


def _dirs(tmp_path):
    """Checkpoint directories whose tokenizers AutoTokenizer resolves differently: a copy of the embedded model
    (PreTrainedTokenizerFast), the same files under a Qwen3 config naming Qwen2Tokenizer (a model's own class), and
    the benchmark shape's stand-in tokenizer."""
    plain = tmp_path / "plain"
    shutil.copytree(DEFAULT_MODEL_DIR, plain)
    qwen = tmp_path / "qwen"
    shutil.copytree(DEFAULT_MODEL_DIR, qwen)
    for name, key, value in (("tokenizer_config.json", "tokenizer_class", "Qwen2Tokenizer"),
                             ("config.json", "model_type", "qwen3")):  # fmt: skip
        data = json.loads((qwen / name).read_text())
        (qwen / name).write_text(json.dumps({**data, key: value}))
    from benchmarks.shapes import write_shape

    return [plain, qwen, write_shape("qwen3-0.6b")]


def _load_in_a_fresh_process(directory, env) -> tuple[str, list[str]]:
    code = (
        "import sys; from coordinator.tokenizer_loader import load_tokenizer;"
        f"t = load_tokenizer({str(directory)!r});"
        "print(type(t).__module__ + '.' + type(t).__qualname__);"
        "print(sorted(m for m in ('transformers.models.auto.tokenization_auto',) if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=START_S, env=env)
    assert out.returncode == 0, out.stderr
    cls, auto = out.stdout.strip().splitlines()[-2:]
    return cls, eval(auto)


def test_a_later_start_builds_autotokenizers_class_without_its_import(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "cache"))
    env = {**os.environ, "NANOSERVE_CACHE": str(tmp_path / "cache")}
    for directory in _dirs(tmp_path):
        first_cls, first_auto = _load_in_a_fresh_process(directory, env)  # AutoTokenizer, its choice kept
        later_cls, later_auto = _load_in_a_fresh_process(directory, env)
        reference = AutoTokenizer.from_pretrained(str(directory))
        want = type(reference).__module__ + "." + type(reference).__qualname__
        assert first_cls == later_cls == want, directory
        assert first_auto and not later_auto, directory  # the later start never imported AutoTokenizer
        _same(load_tokenizer(str(directory)), reference)
    classes = {type(AutoTokenizer.from_pretrained(str(d))) for d in _dirs(tmp_path / "again")}
    assert len(classes) >= 2 and "Qwen2Tokenizer" in {c.__name__ for c in classes}  # not one class for all


def test_a_changed_directory_or_a_bad_entry_goes_back_to_autotokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "cache"))
    env = {**os.environ, "NANOSERVE_CACHE": str(tmp_path / "cache")}
    directory = _dirs(tmp_path)[1]
    _load_in_a_fresh_process(directory, env)
    entries = list((tmp_path / "cache" / "tokenizer_class").glob("*.json"))
    assert len(entries) == 1
    entries[0].write_text(json.dumps({"module": "transformers", "name": "NoSuchTokenizer"}))  # a bad entry
    cls, auto = _load_in_a_fresh_process(directory, env)
    assert cls.endswith("Qwen2Tokenizer") and auto  # AutoTokenizer again, and the entry rewritten
    assert json.loads(entries[0].read_text())["name"] == "Qwen2Tokenizer"
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(
        json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"})
    )
    cls, auto = _load_in_a_fresh_process(directory, env)  # another key: AutoTokenizer decides again
    assert auto and cls == type(AutoTokenizer.from_pretrained(str(directory))).__module__ + "." + cls.rsplit(".")[-1]
