"""coordinator/tokenizer_loader.py: the embedded default model's tokenizer is built by its class directly, and is the
same tokenizer AutoTokenizer builds (class, settings, vocabulary, encodings, chat prompts); it loads without
transformers' auto classes (the start-up time it saves); any other directory goes through AutoTokenizer."""

from __future__ import annotations

import shutil
import subprocess
import sys

from transformers import AutoTokenizer

from coordinator.tokenizer_loader import is_embedded_model, load_tokenizer, tokenizer_class
from model.tiny import DEFAULT_MODEL_DIR
from tests.support.timeouts import START_S

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
    assert a.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == b.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True
    )


def test_the_embedded_models_tokenizer_is_the_one_autotokenizer_builds():
    assert tokenizer_class("") is tokenizer_class(DEFAULT_MODEL_DIR) is not AutoTokenizer  # "": the engine's default
    assert is_embedded_model(DEFAULT_MODEL_DIR) and is_embedded_model(str(DEFAULT_MODEL_DIR / ".." / "default_model"))
    _same(load_tokenizer(str(DEFAULT_MODEL_DIR)), AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR)))


def test_another_directory_goes_through_autotokenizer(tmp_path):
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
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
