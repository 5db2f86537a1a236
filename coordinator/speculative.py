"""Speculative decoding's settings (vLLM's ``speculative_config`` dict: ``--speculative-config JSON`` or
``LLM(speculative_config=...)``), checked key by key, and the engine's counters of drafts and acceptance.

n-gram drafts are proposed in the coordinator (coordinator/ngram.py, scheduled by coordinator/spec_schedule.py) and
verified by the workers in one target forward of 1 + d positions per sequence. EAGLE-3 drafts are made on the workers
(worker/eagle_drafter.py); its draft checkpoint is found and checked against the target here, before any worker
starts (model/eagle3_config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

METHODS = ("ngram", "eagle3")
# vLLM's default prompt-lookup window when neither end is given
DEFAULT_LOOKUP = 5
# Above this many running sequences, proposals stop (vLLM's disable_by_batch_size): a verify row is synchronous (it
# gives up the async overlap for its sequence) and each proposal is numpy work per sequence on the coordinator, while
# a decode step at 8+ sequences is already well amortized; so n-gram pays at low batch only.
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size", "model")


class SpeculativeConfigError(ValueError):
    """A bad speculative_config; the message names the key (``speculative_config.KEY``)."""


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # k: drafts proposed per sequence and step at most
    prompt_lookup_min: int = DEFAULT_LOOKUP  # n-gram: shortest suffix matched
    prompt_lookup_max: int = DEFAULT_LOOKUP  # n-gram: longest suffix matched (tried first)
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    model: str = ""  # eagle3: the draft checkpoint (directory or Hub id)

    @classmethod
    def from_dict(cls, raw: object) -> SpeculativeConfig:
        """Check a speculative_config dict key by key; SpeculativeConfigError names the first bad one."""
        if not isinstance(raw, dict):
            raise SpeculativeConfigError(f"speculative_config must be a JSON object (dict), got {type(raw).__name__}")
        unknown = sorted(set(raw) - set(_KEYS), key=str)
        if unknown:
            raise SpeculativeConfigError(
                f"speculative_config.{unknown[0]}: unknown key; known keys: {', '.join(_KEYS)}"
            )
        method = raw.get("method")
        if method not in METHODS:
            raise SpeculativeConfigError(
                f"speculative_config.method must be one of {', '.join(METHODS)}, got {method!r}"
            )
        k = _int(raw, "num_speculative_tokens", None, low=1)
        lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        if method == "ngram":  # as vLLM: one end given alone is both ends
            lo = _int(raw, "prompt_lookup_min", DEFAULT_LOOKUP if hi is None else hi, low=1)
            hi = _int(raw, "prompt_lookup_max", lo, low=1)
            if lo > hi:
                raise SpeculativeConfigError(
                    f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})"
                )
        else:
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                if key in raw:
                    raise SpeculativeConfigError(f"speculative_config.{key} is an ngram setting, not {method}'s")
            lo = hi = DEFAULT_LOOKUP
        batch = _int(raw, "disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE, low=1)
        model = raw.get("model", "")
        if not isinstance(model, str):
            raise SpeculativeConfigError(f"speculative_config.model must be a string, got {model!r}")
        if method == "eagle3" and not model:
            raise SpeculativeConfigError("speculative_config.model is required with method eagle3 (its draft model)")
        if method == "ngram" and model:
            raise SpeculativeConfigError("speculative_config.model: ngram takes no draft model")
        return cls(method, k, lo, hi, batch, model)


def _int(raw: dict, key: str, default: int | None, low: int) -> int:
    value = raw.get(key, default)
    if value is None:
        raise SpeculativeConfigError(f"speculative_config.{key} is required")
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise SpeculativeConfigError(f"speculative_config.{key} must be an integer >= {low}, got {value!r}")
    return value


def check_startable(cfg: SpeculativeConfig, target, download_dir: str = "") -> SpeculativeConfig:
    """The config ready to run with ``target`` (a ModelConfig): an EAGLE-3 draft named by a Hub id becomes its local
    directory, and its checkpoint must fit the target; SpeculativeConfigError names the field that does not."""
    if cfg.method != "eagle3":
        return cfg
    from coordinator.model_source import ModelSourceError, resolve
    from model.eagle3_config import Eagle3CheckpointError, read_eagle3

    try:
        directory = resolve(cfg.model, "", download_dir)
        read_eagle3(directory, target)
    except (ModelSourceError, Eagle3CheckpointError, FileNotFoundError) as e:
        raise SpeculativeConfigError(f"speculative_config.model: {e}") from None
    return replace(cfg, model=directory)


@dataclass(slots=True)
class SpecStats:
    """vLLM's spec-decode counters: verify rows (drafts), draft tokens, accepted tokens, accepted per position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def record(self, drafts: np.ndarray, accepted: np.ndarray) -> None:
        """One step's verify rows: their draft counts and accepted counts."""
        self.num_drafts += len(drafts)
        self.num_draft_tokens += int(drafts.sum())
        self.num_accepted_tokens += int(accepted.sum())
        width = int(drafts.max(initial=0))
        if width > len(self.accepted_per_pos):
            self.accepted_per_pos = np.pad(self.accepted_per_pos, (0, width - len(self.accepted_per_pos)))
        self.accepted_per_pos[:width] += (accepted[:, None] > np.arange(width)).sum(0)

    def as_dict(self, k: int) -> dict:
        per_pos = np.zeros(k, np.int64)
        per_pos[: min(k, len(self.accepted_per_pos))] = self.accepted_per_pos[:k]
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": per_pos.tolist(),
        }
