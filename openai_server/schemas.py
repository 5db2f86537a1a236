"""Request bodies (pydantic): OpenAI's fields plus vLLM's sampling extras. Unknown fields are ignored with a
warning, as vLLM does; a field of the wrong type is a 400 naming it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from protocol.sampling_params import I64_END


def _token_ids(ids: list, what: str) -> list[int]:
    """``ids`` if every one is an int in [0, 2^63) (the wire's range; the engine checks the vocabulary), else a
    ValueError saying so. One pass of C-speed calls: a body may hold a million ids."""
    if set(map(type, ids)) - {int}:
        raise ValueError(f"{what} must be token ids (ints)")
    if ids and not (0 <= min(ids) and max(ids) < I64_END):
        raise ValueError(f"{what} must be token ids in [0, 2^63), got {min(ids) if min(ids) < 0 else max(ids)}")
    return ids


def _prompt(value: Any) -> Any:
    """A completions prompt: a string, a list of strings, a list of token ids or a list of those. Checked here
    rather than as pydantic's union, which validates a long id list against every member (seconds for a few
    MB of ids, with the event loop blocked) before it finds the one that fits."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of those")
    kinds = set(map(type, value))
    if kinds <= {str}:
        return value
    if kinds <= {int}:
        return _token_ids(value, "prompt")
    if kinds <= {list}:
        return [_token_ids(ids, f"prompt[{i}]") for i, ids in enumerate(value)]
    raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of those")


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (a string) -> bias in [-100, 100]
    user: str | None = None
    response_format: dict[str, Any] | None = None  # text, json_object or json_schema (params.structured_outputs)
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None  # top-N logprobs of every prompt token (completions: per choice; chat: once)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: max_model_len)
    allowed_token_ids: list[int] | None = None  # sample only among these token ids


class CompletionRequest(_Request):
    prompt: Any  # str | list[str] | list[int] | list[list[int]], checked by _prompt
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        return _prompt(value)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, reasoning_content...: passed to the template

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: continue the last (assistant) message instead of closing it


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int]

    @field_validator("tokens")
    @classmethod
    def _check_tokens(cls, value: list[int]) -> list[int]:
        return _token_ids(value, "tokens")
