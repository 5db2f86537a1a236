"""HF transformers as the oracle of the HTTP tests: greedy continuations, chat prompts and logprobs of a checkpoint
directory, in float32."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


class Oracle:
    """HF transformers on the same checkpoint: greedy continuations and logprobs (float32)."""

    def __init__(self, model_dir: Path) -> None:
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None  # ignore_eos
        self.model.generation_config.repetition_penalty = 1.0  # plain greedy, whatever the checkpoint recommends

    def ids(self, prompt: str | list[int]) -> list[int]:
        return prompt if isinstance(prompt, list) else self.tok.encode(prompt, add_special_tokens=False)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tok.encode(text, add_special_tokens=False)

    @torch.no_grad()
    def greedy(self, ids: list[int], n: int) -> list[int]:
        x = torch.tensor([ids])
        out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False)
        return out[0, len(ids) :].tolist()

    def text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    @torch.no_grad()
    def logprobs(self, prompt: list[int], output: list[int]) -> torch.Tensor:
        """[len(output), vocab] log-probabilities of each output position."""
        logits = self.model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
        return torch.log_softmax(logits.double(), -1)
