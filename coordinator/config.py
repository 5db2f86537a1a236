"""Engine arguments (vLLM's names where vLLM has one). An unknown argument is an error, never dropped."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(slots=True)
class EngineConfig:
    model: str = ""  # "" = the embedded tiny default model
    tensor_parallel_size: int = 1
    device: str = ""  # "" = cuda when available, else cpu
    dtype: str = "auto"
    max_model_len: int = 0  # 0 = the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    num_kv_blocks: int = 0  # > 0 overrides memory-based sizing
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int = 1 << 30  # CPU KV budget when num_kv_blocks is 0
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    load_format: str = "auto"
    seed: int = 0
    attention_backend: str = "auto"
    async_scheduling: bool = True  # schedule step N+1 while the workers run step N
    async_depth: int = 2  # steps sent ahead of the oldest unapplied result: 2 also sends N+2 before N is read
    external_workers: bool = False  # workers join by themselves (torchrun) instead of being spawned
    worker_address: str = ""  # where workers connect; "" = a private ipc socket
    worker_timeout_s: float = 120.0  # start-up: how long to wait for every rank
    quantization: str = ""  # "fp8": FP8 linear layers, quantized at load (an FP8 checkpoint is served as stored)
    kv_cache_dtype: str = "auto"  # "auto" = the model's dtype; "fp8": e4m3 KV cache, twice the tokens per byte

    def __post_init__(self) -> None:
        if not self.device:
            self.device = _default_device()
        checks = [
            (self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1"),
            (self.device in ("cpu", "cuda"), "device", "must be 'cpu' or 'cuda'"),
            (self.max_model_len >= 0, "max_model_len", "must be >= 0"),
            (self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1"),
            (
                self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
                "block_size",
                "must be a power of 2",
            ),
            (self.num_kv_blocks >= 0, "num_kv_blocks", "must be >= 0"),
            (0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "must be in (0, 1]"),
            (self.load_format in ("auto", "dummy"), "load_format", "must be 'auto' or 'dummy'"),
            (self.async_depth in (1, 2), "async_depth", "must be 1 or 2"),  # the workers' rings hold 2 + 2
            (self.quantization in ("", "fp8"), "quantization", "must be '' or 'fp8'"),
            (self.kv_cache_dtype in ("auto", "fp8", "fp8_e4m3"), "kv_cache_dtype", "must be 'auto' or 'fp8'"),
        ]
        for ok, name, what in checks:
            if not ok:
                raise ValueError(f"{name} {what}, got {getattr(self, name)!r}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        return cls(**kwargs)
