"""The offline API in vLLM's shape: vLLM's quickstart runs with only its import line (and the model) changed;
``generate`` takes vLLM's prompt forms and n samples; ``chat`` renders the chat template."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from coordinator.prompts import configured_generation_defaults, render_chat
from nanoserve import LLM, SamplingParams
from protocol.client_messages import ChatPrompt
from protocol.errors import RequestError
from tests.support.processes import ROOT

QUICKSTART = """
from nanoserve import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

llm = LLM(model=MODEL)

outputs = llm.generate(prompts, sampling_params)

for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
"""


def test_vllm_quickstart_runs(tiny_tied):
    script = QUICKSTART.replace("MODEL", repr(str(tiny_tied)))
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 4
    assert lines[2].startswith("Prompt: 'The capital of France is', Generated text: '")


@pytest.fixture(scope="module")
def llm(tiny_tied):
    with LLM(str(tiny_tied), max_model_len=256, num_kv_blocks=64) as llm:
        yield llm


def test_prompt_forms_n_samples_and_chat(llm):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    ids = llm.get_tokenizer().encode("def hello(", add_special_tokens=False)
    by_text, by_dict, by_ids = llm.generate(
        ["def hello(", {"prompt": "def hello("}, {"prompt_token_ids": ids}], greedy, use_tqdm=False
    )
    assert by_text.prompt == by_dict.prompt == "def hello(" and by_ids.prompt is None
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids == ids
    assert by_text.outputs[0].token_ids == by_dict.outputs[0].token_ids == by_ids.outputs[0].token_ids
    first = by_text.outputs[0]
    assert (first.index, first.finish_reason, by_text.finished) == (0, "length", True)
    assert first.cumulative_logprob == pytest.approx(sum(next(iter(d.values())).logprob for d in first.logprobs))
    # vLLM's shape: {token id: Logprob}; greedy picks the top token, so the sampled one is the entry, ranked 1
    tok = llm.get_tokenizer()
    for token, entry in zip(first.token_ids, first.logprobs):
        assert list(entry) == [token] and entry[token].rank == 1
        assert entry[token].decoded_token == tok.decode([token]) and entry[token].logprob <= 0
    assert by_text.text == first.text and by_text.token_ids == first.token_ids  # Completion's names still work

    (sampled,) = llm.generate("def hello(", SamplingParams(n=3, seed=5, max_tokens=8, ignore_eos=True), False)
    assert [o.index for o in sampled.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in sampled.outputs}) > 1  # seed + index per sample
    (again,) = llm.generate("def hello(", SamplingParams(n=3, seed=5, max_tokens=8, ignore_eos=True), False)
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in sampled.outputs]
    # vLLM takes any int64 seed (chat UIs send -1); the same seed, the same tokens
    unseeded = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3)
    minus_one = SamplingParams(seed=-1, max_tokens=8, ignore_eos=True)
    (neg,), (neg2,) = (llm.generate("def hello(", minus_one, False) for _ in range(2))
    assert neg.outputs[0].token_ids == neg2.outputs[0].token_ids
    # sampled at temperature 1 with the top 3: each entry ranks its top tokens 1..3 by logprob; a sampled token
    # outside them comes first with no rank
    (wide,) = llm.generate("def hello(", unseeded, False)
    for token, entry in zip(wide.outputs[0].token_ids, wide.outputs[0].logprobs):
        assert next(iter(entry)) == token and len(entry) in (3, 4)
        top = sorted((e for t, e in entry.items() if len(entry) == 3 or t != token), key=lambda e: -e.logprob)
        assert [e.rank for e in top] == [1, 2, 3]
        assert len(entry) == 3 or entry[token].rank is None

    messages = [{"role": "user", "content": "hi"}]
    text = llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    (chat,) = llm.chat(messages, greedy, use_tqdm=False)
    (plain,) = llm.generate(text, greedy, use_tqdm=False)
    assert chat.prompt == text and chat.outputs[0].token_ids == plain.outputs[0].token_ids
    two = llm.chat([messages, messages + [{"role": "assistant", "content": "yo"}]], greedy, use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == plain.outputs[0].token_ids


def test_max_tokens_none_runs_to_max_model_len(llm):
    """As vLLM: max_tokens=None generates up to max_model_len (256 here); the caller's params stay as given."""
    ids = list(range(3, 203))
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 256 - 200 and out.outputs[0].finish_reason == "length"
    assert params.max_tokens is None
    assert llm.engine.config.max_model_len == llm.engine.max_model_len == 256


@pytest.mark.parametrize(
    "prompts, message",
    [
        (None, r"^prompts must be a string, a list of token ids, .*, or a list of those; got NoneType$"),
        (5, r"^prompts must be a string, .*; got int$"),
        (["hi", None], r"^prompts\[1\] must be a string, a list of token ids, \{'prompt': str\} or .*; got NoneType$"),
        ([["hi"]], r"^prompts\[0\] must be .*; got list$"),
        ({"prompt": 5}, r"^prompts\[0\]\['prompt'\] must be a string, got int$"),
        ({"prompt_token_ids": 5}, r"^prompts\[0\]\['prompt_token_ids'\] must be a list of token ids, got int$"),
    ],
)
def test_a_prompt_of_no_accepted_form_is_named(llm, prompts, message):
    with pytest.raises(TypeError, match=message):
        llm.generate(prompts, use_tqdm=False)
    assert not llm.engine.requests


def test_chat_takes_text_parts_as_the_http_api_does(llm):
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]
    (chat,) = llm.chat([{"role": "user", "content": parts}], greedy, use_tqdm=False)
    (plain,) = llm.chat([{"role": "user", "content": "hi\nthere"}], greedy, use_tqdm=False)
    assert chat.prompt == plain.prompt and chat.outputs[0].token_ids == plain.outputs[0].token_ids
    with pytest.raises(ValueError, match=r"^messages\[0\].content: only text parts are supported$"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], use_tqdm=False)


def test_chat_template_argument_replaces_the_tokenizers(tiny_tied, tmp_path):
    """vLLM's --chat-template: a file's template renders every chat in place of the tokenizer's."""
    path = tmp_path / "chat.jinja"
    path.write_text("{% for m in messages %}<<{{ m['role'] }}:{{ m['content'] }}>>{% endfor %}")
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    with LLM(str(tiny_tied), max_model_len=256, num_kv_blocks=64, chat_template=str(path)) as llm:
        (out,) = llm.chat([{"role": "user", "content": "hi"}], greedy, use_tqdm=False)
    assert out.prompt == "<<user:hi>>" and len(out.outputs[0].token_ids) == 2


def test_chat_takes_its_own_template_offline_but_a_request_cannot_set_one(llm):
    """LLM.chat(chat_template=...) as vLLM's; ``chat_template_kwargs`` (what an HTTP request sends) may not
    replace the server's template."""
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    messages = [{"role": "user", "content": "hi"}]
    (out,) = llm.chat(messages, greedy, use_tqdm=False, chat_template="{{ messages[0]['content'] }}!")
    assert out.prompt == "hi!"
    prefilled = [*messages, {"role": "assistant", "content": "yes,"}]  # vLLM's continue_final_message
    (out,) = llm.chat(prefilled, greedy, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert out.prompt == llm.get_tokenizer().apply_chat_template(prefilled, tokenize=False, continue_final_message=True)
    assert out.prompt.endswith("yes,")
    with pytest.raises(ValueError, match="^chat_template_kwargs may not set chat_template$"):
        llm.chat(messages, greedy, use_tqdm=False, chat_template_kwargs={"chat_template": "{{ 'x' }}"})


def test_a_tokenizer_without_a_chat_template_names_the_way_to_give_one():
    chat = ChatPrompt([{"role": "user", "content": "hi"}], None, True)
    with pytest.raises(RequestError, match=r"no chat template: start the engine with one \(--chat-template FILE\)"):
        render_chat(SimpleNamespace(chat_template=None), chat)


def test_tokenizer_and_generation_config_from_other_directories(tiny_tied, tmp_path):
    """vLLM's --tokenizer and --generation-config DIR: a checkpoint without tokenizer files serves with another
    directory's tokenizer, and its sampling defaults come from the directory given."""
    model, gen = tmp_path / "weights", tmp_path / "gen"
    model.mkdir(), gen.mkdir()
    for name in ("config.json", "model.safetensors"):
        (model / name).symlink_to(tiny_tied / name)
    (gen / "generation_config.json").write_text(json.dumps({"top_k": 1, "max_new_tokens": 7}))
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    args = dict(max_model_len=256, num_kv_blocks=64, tokenizer=str(tiny_tied), generation_config=str(gen))
    with LLM(str(model), **args) as llm:
        assert llm.engine.generation_defaults == {"top_k": 1, "max_tokens": 7}
        (out,) = llm.generate("once upon a time", greedy, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].text
    assert out.prompt_token_ids == llm.get_tokenizer().encode("once upon a time")


def test_generation_config_settings_resolve_as_vllms(tmp_path):
    model, other = tmp_path / "model", tmp_path / "other"
    for d, temperature in ((model, 0.5), (other, 0.3)):
        d.mkdir()
        (d / "generation_config.json").write_text(json.dumps({"temperature": temperature}))
    assert configured_generation_defaults("auto", model) == {"temperature": 0.5}
    assert configured_generation_defaults("vllm", model) == {}
    assert configured_generation_defaults(str(other), model) == {"temperature": 0.3}


def test_truncate_prompt_tokens_keeps_the_prompts_end(llm):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens are all the model sees (and all it reports)."""
    ids = list(range(100, 140))
    greedy = dict(temperature=0, max_tokens=4, ignore_eos=True)
    (cut,) = llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(truncate_prompt_tokens=10, **greedy), use_tqdm=False
    )
    (tail,) = llm.generate({"prompt_token_ids": ids[-10:]}, SamplingParams(**greedy), use_tqdm=False)
    assert cut.prompt_token_ids == ids[-10:] and cut.outputs[0].token_ids == tail.outputs[0].token_ids
    (whole,) = llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(truncate_prompt_tokens=-1, **greedy), use_tqdm=False
    )
    assert whole.prompt_token_ids == ids  # -1: up to max_model_len, which this prompt is under
    with pytest.raises(ValueError, match=r"^truncate_prompt_tokens must be None, -1 \(max_model_len\) or an int >= 1"):
        SamplingParams(truncate_prompt_tokens=0)
