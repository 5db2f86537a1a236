"""Prompt variants the coordinator turns into token ids (chat conversations through the tokenizer's template),
the Tokenize/Detokenize requests, and the sampling defaults a model ships in its generation_config.json."""

from __future__ import annotations

import json
from pathlib import Path

from coordinator.detokenizer import TokenTexts
from protocol.chat_content import content_text
from protocol.client_messages import ChatPrompt, Detokenize, DetokenizeReply, Tokenize, TokenizeReply
from protocol.errors import RequestError

# generation_config.json key -> SamplingParams field (the keys vLLM takes as defaults)
_GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# template arguments a request may not set: how the template is called, and the template itself (the server's
# operator chose it, as vLLM keeps request templates behind a flag)
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "conversation", "tokenize", "add_generation_prompt", "return_dict", "chat_template"}
)


def configured_generation_defaults(setting: str, model_dir: str | Path) -> dict:
    """The engine's ``generation_config`` setting resolved as vLLM's: "auto" reads the model's file, "vllm" none,
    anything else is a directory holding one."""
    if setting == "vllm":
        return {}
    return generation_defaults(model_dir if setting == "auto" else setting)


def generation_defaults(model_dir: str | Path) -> dict:
    """Sampling defaults from ``model_dir``/generation_config.json (SamplingParams field -> value); {} without."""
    path = Path(model_dir) / "generation_config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    out = {}
    for key, field in _GENERATION_KEYS.items():
        value = raw.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[field] = value
    return out


def eos_token_ids(config_ids, tokenizer) -> set[int]:
    """The ids that end a reply: the model config's EOS ids and the tokenizer's."""
    ids = set(config_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _check_messages(messages, max_chars: int | None) -> list[dict]:
    """The messages as the template takes them: text parts joined (protocol/chat_content.py), in copies. Their
    contents' total length is bounded by ``max_chars`` before any template runs."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects")
    out = []
    total = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string 'role'")
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            m = {**m, "content": content_text(content, f"messages[{i}].content")}
        total += len(m["content"]) if isinstance(m.get("content"), str) else 0
        out.append(m)
    if max_chars is not None and total > max_chars:
        raise RequestError(f"messages ({total} characters of content) cannot fit in {max_chars} characters")
    return out


def render_chat(tokenizer, chat: ChatPrompt, chat_template: str | None = None, max_chars: int | None = None) -> str:
    """The prompt text of a conversation, through ``chat_template`` (the offline caller's own) or the tokenizer's;
    RequestError when its contents are over ``max_chars`` characters (checked before the template runs)."""
    messages = _check_messages(chat.messages, max_chars)
    kwargs = chat.chat_template_kwargs or {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise RequestError("chat_template_kwargs must be an object with string keys")
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise RequestError(f"chat_template_kwargs may not set {', '.join(reserved)}")
    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise RequestError(
            "this model's tokenizer has no chat template: start the engine with one (--chat-template FILE) or use "
            "completions instead of chat"
        )
    try:
        text = tokenizer.apply_chat_template(
            messages,
            chat_template=chat_template,
            tokenize=False,
            add_generation_prompt=chat.add_generation_prompt,
            **kwargs,
        )
    except Exception as e:  # a template that raises (jinja's raise_exception) or chokes on the input
        raise RequestError(f"messages: the chat template failed: {type(e).__name__}: {e}") from None
    if not isinstance(text, str):
        raise RequestError("messages: the chat template did not produce text")
    return text


def encode_text(tokenizer, text: str, add_special_tokens: bool, max_model_len: int | None = None) -> list[int]:
    """``tokenizer.encode``'s ids, from the Rust tokenizer itself where there is one, through ``encode_batch``: it
    releases the GIL while it encodes (its ``encode`` does not), where transformers' wrapper then held it for
    seconds of a 7 MB text (3.8 s of a 63 s encode on a loaded 2-core box) building masks nothing here reads.
    With ``max_model_len``, a prompt that fills it is refused before its ids become a list (that holds the GIL)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow (Python) tokenizer
        ids = list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return _fits(len(ids), max_model_len) and ids
    (encoding,) = backend.encode_batch([text], add_special_tokens=add_special_tokens)
    return _fits(len(encoding), max_model_len) and encoding.ids


def _fits(num_tokens: int, max_model_len: int | None) -> bool:
    if max_model_len is not None and num_tokens >= max_model_len:
        raise no_room(num_tokens, max_model_len)
    return True


def no_room(num_tokens: int, max_model_len: int) -> RequestError:
    """A prompt that fills max_model_len, named as the prompt's fault whatever max_tokens is."""
    return RequestError(
        f"prompt ({num_tokens} tokens) leaves no room for output tokens in max_model_len ({max_model_len})"
    )


def tokenize_reply(tokenizer, max_model_len: int, msg: Tokenize, max_chars: int) -> TokenizeReply:
    """Answer a Tokenize request (RequestError names the problem, a text over ``max_chars`` characters too, before
    it is tokenized)."""
    prompt = msg.prompt
    if isinstance(prompt, ChatPrompt):
        prompt = render_chat(tokenizer, prompt, max_chars=max_chars)
    if not isinstance(prompt, str):
        raise RequestError("prompt must be a string or a chat conversation")
    if len(prompt) > max_chars:
        raise RequestError(f"prompt ({len(prompt)} characters) is over /tokenize's limit of {max_chars} characters")
    ids = encode_text(tokenizer, prompt, msg.add_special_tokens)
    strs = tokenizer.convert_ids_to_tokens(ids) if msg.return_token_strs else None
    return TokenizeReply(msg.request_id, ids, max_model_len, strs)


def detokenize_reply(tokenizer, vocab_size: int, msg: Detokenize, token_texts: TokenTexts) -> DetokenizeReply:
    """Answer a Detokenize request (RequestError for ids outside the vocabulary); ``token_texts``: each id's own
    text, for ``per_token``."""
    ids = msg.token_ids
    if ids and not (min(ids) >= 0 and max(ids) < vocab_size):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        raise RequestError(f"tokens out of vocabulary [0, {vocab_size}): {bad[:5]}")  # named by /detokenize's field
    tok = tokenizer
    text = tok.decode(ids, skip_special_tokens=msg.skip_special_tokens)
    per_token = None
    if msg.per_token:  # each id alone, special tokens kept: a logprob entry names the token it is about
        texts = token_texts.of(ids)
        per_token = [texts[t] for t in ids]
    return DetokenizeReply(msg.request_id, text, per_token)
