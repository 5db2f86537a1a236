"""training/: the default model's held-out files are fixed by their paths alone, and its packaged tokenizer is a
byte-level BPE that round-trips any text, with the chat template and both end-of-text ids the engine stops on."""

from __future__ import annotations

import json

from transformers import AutoTokenizer

from model.tiny import DEFAULT_MODEL_DIR
from training.corpus import EOT, IM_END, chat_examples, held_out, split, stdlib_files


def test_the_held_out_files_depend_on_their_paths_alone():
    files = stdlib_files()
    train, held = split(files)
    assert held and not {p for p, _ in train} & {p for p, _ in held}
    assert 0.005 < len(held) / len(files) < 0.05
    # another Python's standard library (more or fewer files) holds out the same paths where it has them
    sub_train, sub_held = split(files[::3])
    assert {p for p, _ in sub_held} == {p for p, _ in held} & {p for p, _ in files[::3]}
    assert all(held_out(p) for p, _ in sub_held) and not any(held_out(p) for p, _ in sub_train)


def test_chat_examples_ask_for_a_function_and_answer_with_it():
    text = 'def add(a, b):\n    """Return a + b."""\n    return a + b\n\n\ndef _private():\n    pass\n'
    (example,) = chat_examples([("m.py", text)])
    assert example.startswith("<|im_start|>user\nWrite a Python function `add`: Return a + b.<|im_end|>\n")
    function = text.split("\n\n\n")[0]
    assert example.endswith(f"<|im_start|>assistant\n```python\n{function}\n```<|im_end|>\n")


def test_the_packaged_tokenizer_round_trips_any_text_and_stops_on_both_ends():
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    for text in ["def f(x):\n\treturn x  # ok\n", "Ünïcödé ✓ 你好 🙂 \x00\x7f", "    " * 9 + "pass"]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.eos_token == EOT
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    assert sorted(config["eos_token_id"]) == sorted(tok.convert_tokens_to_ids([EOT, IM_END]))
    assert config["vocab_size"] == len(tok)
