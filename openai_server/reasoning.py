"""Reasoning parsers: split a model's output text into ``reasoning_content`` and ``content``, as it streams."""

from __future__ import annotations


class Qwen3ReasoningParser:
    """Qwen3 thinks in a ``<think>...</think>`` block at the start of its output. Text inside goes to reasoning,
    text after to content; an output that does not start with ``<think>`` is all content (e.g. with
    ``enable_thinking: false`` the template closes the block in the prompt), unless the prompt itself opened the
    block (``opened``: Qwen3 thinking-only templates end the prompt with ``<think>``). Text that may be the start
    of a tag is held back until it is not."""

    START, END = "<think>", "</think>"

    def __init__(self, opened: bool = False) -> None:
        self.state = "reasoning" if opened else "start"  # start -> reasoning -> content, or start -> content
        self.held = ""
        self.thought = opened  # the output (or the prompt before it) opened a <think> block

    @classmethod
    def opens_block(cls, prompt_tail: str) -> bool:
        """Whether a prompt ending in ``prompt_tail`` leaves a <think> block open for the output to continue."""
        return prompt_tail.rfind(cls.START) > prompt_tail.rfind(cls.END)

    def feed(self, text: str) -> tuple[str, str]:
        """New (reasoning, content) text for the next piece of output."""
        if self.state == "content":
            return "", text
        self.held += text
        if self.state == "start":
            head = self.held.lstrip()
            if head.startswith(self.START):
                self.state, self.held, self.thought = "reasoning", head[len(self.START) :], True
            elif self.START.startswith(head):
                return "", ""  # maybe the start of <think>: wait
            else:
                self.state, held, self.held = "content", self.held, ""
                return "", held
        end = self.held.find(self.END)
        if end >= 0:
            reasoning, content = self.held[:end], self.held[end + len(self.END) :]
            self.state, self.held = "content", ""
            return reasoning, content
        keep = partial_tag_suffix(self.held, self.END)
        ready = self.held[: len(self.held) - keep]
        self.held = self.held[len(ready) :]
        return ready, ""

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output is complete."""
        held, self.held = self.held, ""
        return (held, "") if self.state == "reasoning" else ("", held)

    @classmethod
    def split(cls, text: str, opened: bool = False) -> tuple[str | None, str | None]:
        """A whole output's (reasoning or None, content; None when a reasoning block left none, as vLLM)."""
        p = cls(opened)
        r1, c1 = p.feed(text)
        r2, c2 = p.finish()
        if not p.thought:
            return None, c1 + c2
        return r1 + r2, (c1 + c2) or None


def partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser}
