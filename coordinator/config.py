"""Engine arguments (vLLM's names where vLLM has one). An unknown argument is an error, never dropped; a bad value
is refused here, before any worker starts. Each field carries its description and, where the set is fixed, its
choices: launch.py turns both into its flags."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.gpu_probe import cuda_gpu_count
from settings.defaults import ATTENTION_BACKENDS, DTYPES, SERVER_PREFILL_BESIDE_DECODES
from settings.loopback import is_loopback_endpoint

if TYPE_CHECKING:
    from model.config import ModelConfig
    from protocol.messages import WorkerConfig

DEVICES = ("cpu", "cuda")
LOAD_FORMATS = ("auto", "dummy")
KV_DTYPES = ("auto", "fp8", "fp8_e4m3")


def _arg(default, help: str, choices: tuple = ()):
    return field(default=default, metadata={"help": help, "choices": choices})


def _default_device() -> str:
    """ "cuda" where a spawned worker would see a GPU, counted without torch where the driver can tell
    (coordinator/gpu_probe.py): the coordinator then starts without it."""
    return "cuda" if cuda_gpu_count() > 0 else "cpu"


class EngineArgError(ValueError):
    """A bad engine argument; ``name`` is its field (launch.py's flag: --name-with-dashes)."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


def _chat_template_text(value: str) -> str:
    """``chat_template`` as vLLM's ``--chat-template`` takes it: a file's path, or the template itself."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise EngineArgError("chat_template", f"chat_template: cannot read {value!r}: {e}") from None
    if "{" in value:  # Jinja: {{ ... }} or {% ... %}
        return value
    raise EngineArgError("chat_template", f"chat_template: {value!r} is neither a file nor a Jinja template")


@dataclass(slots=True)
class EngineConfig:
    model: str = _arg(
        "", "model directory (HF layout) or Hugging Face Hub id (org/name); default: the embedded tiny model"
    )
    tensor_parallel_size: int = _arg(1, "worker processes, one per device (tensor-parallel ranks)")
    device: str = _arg("", "default: cuda when available, else cpu", DEVICES)
    dtype: str = _arg("auto", "weights and activations; auto = the checkpoint's", DTYPES)
    max_model_len: int = _arg(0, "longest prompt + output in tokens; 0 = the model's limit")
    max_num_seqs: int = _arg(256, "sequences in one step at most")
    max_num_batched_tokens: int = _arg(8192, "tokens in one step at most (prefills are chunked to fit)")
    max_prefill_beside_decodes: int = _arg(
        0,
        "tokens a step carries in all while sequences decode: prompt tokens up to this less the decode rows, at least"
        " half of it (a quarter of the waiting prompt tokens if more, all of max_num_batched_tokens for a larger"
        " backlog), so a prompt does not stall every stream's next token;"
        f" 0 = no cap; launch.py and nanoserve serve default to {SERVER_PREFILL_BESIDE_DECODES}",
    )
    block_size: int = _arg(16, "tokens per KV-cache block (a power of 2)")
    num_kv_blocks: int = _arg(0, "KV blocks per rank; 0 = size from memory")
    gpu_memory_utilization: float = _arg(0.9, "share of device memory for weights, activations and the KV cache")
    kv_cache_memory_bytes: int = _arg(1 << 30, "KV-cache budget on the CPU when num_kv_blocks is 0")
    enable_prefix_caching: bool = _arg(True, "reuse the KV blocks of a prompt prefix seen before")
    enforce_eager: bool = _arg(False, "no CUDA graphs: every step runs eagerly")
    load_format: str = _arg(
        "auto", "auto = the checkpoint's weights; dummy = random weights of its shape", LOAD_FORMATS
    )
    seed: int = _arg(0, "seed of random sampling for requests without their own seed (and of dummy weights)")
    attention_backend: str = _arg("auto", "auto = flash-attn or Triton on CUDA, torch on the CPU", ATTENTION_BACKENDS)
    async_scheduling: bool = _arg(True, "schedule step N+1 while the workers run step N")
    async_depth: int = _arg(
        2, "steps sent ahead of the oldest result not yet read back (the workers' rings hold 2 + 2)", (1, 2)
    )
    external_workers: bool = _arg(False, "do not spawn workers: they join with `torchrun ... -m worker --coordinator`")
    worker_address: str = _arg(
        "",
        "ZMQ address the workers connect to (required with external workers), e.g. tcp://127.0.0.1:29600; "
        "a non-loopback one (tcp://0.0.0.0:29600) needs a worker secret",
    )
    # not in repr: an EngineConfig printed or logged does not leak it
    worker_secret: str = field(
        default="",
        repr=False,
        metadata={
            "help": "what every worker must prove it holds (HMAC challenge) before it gets any work; '' = "
            "$NANOSERVE_WORKER_SECRET, else the API key ($NANOSERVE_API_KEY); needed for a non-loopback "
            "worker_address. Prefer the environment: a flag's value shows in the process list",
            "choices": (),
        },
    )
    worker_timeout_s: float = _arg(120.0, "start-up: seconds to wait for every rank")
    quantization: str = _arg(
        "", "fp8: FP8 linear layers, quantized at load ('' = none; an FP8 checkpoint is served as stored)", ("", "fp8")
    )
    kv_cache_dtype: str = _arg("auto", "auto = the model's dtype; fp8: an e4m3 KV cache, twice the tokens", KV_DTYPES)
    tokenizer: str = _arg("", "tokenizer directory or Hugging Face Hub id ('' = the model's)")
    revision: str = _arg("", "the model's revision on the Hugging Face Hub: a branch, tag or commit ('' = main)")
    tokenizer_revision: str = _arg("", "the tokenizer's revision on the Hub, when --tokenizer is a Hub id ('' = main)")
    download_dir: str = _arg(
        "", "the Hugging Face cache to find Hub models in and download them to ('' = $HF_HUB_CACHE or $HF_HOME/hub)"
    )
    trust_remote_code: bool = _arg(
        False,
        "accepted as vLLM accepts it; nanoserve never runs a checkpoint's code, so an architecture it does not "
        "implement is refused either way",
    )
    chat_template: str = _arg(
        "", "a Jinja chat template, or a file holding one, in place of the tokenizer's ('' = the tokenizer's own)"
    )
    generation_config: str = _arg(
        "auto",
        "sampling defaults for requests that leave a field unset: auto = the model's generation_config.json, vllm = "
        "none (each field's own default), or a directory holding a generation_config.json",
    )
    speculative_config: dict | None = _arg(
        None,
        'speculative decoding, as vLLM\'s: {"method": "ngram", "num_speculative_tokens": K, '
        '"prompt_lookup_min": N, "prompt_lookup_max": M, "disable_by_batch_size": B}, or {"method": "eagle3", '
        '"model": DRAFT_DIR_OR_HUB_ID, "num_speculative_tokens": K}; unset = off',
    )

    def __post_init__(self) -> None:
        from coordinator.model_source import ModelSourceError, resolve_sources

        try:
            # Hub ids become local directories here, once (before torch loads for the device default, so a bad id
            # is reported at once): the workers get a directory
            self.model, self.tokenizer = resolve_sources(
                self.model, self.tokenizer, self.revision, self.tokenizer_revision, self.download_dir,
                self.trust_remote_code,
            )  # fmt: skip
        except ModelSourceError as e:
            raise EngineArgError(e.name, str(e)) from None
        if not self.device:
            self.device = _default_device()
        for f in dataclasses.fields(self):
            choices, value = f.metadata["choices"], getattr(self, f.name)
            if choices and value not in choices:
                names = [str(c) for c in choices]
                options = " or ".join(names) if len(names) == 2 else "one of " + ", ".join(names)
                raise EngineArgError(f.name, f"{f.name} must be {options}, got {value!r}")
        checks = [
            (self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1"),
            (self.max_model_len >= 0, "max_model_len", "must be >= 0"),
            (self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1"),
            (self.max_prefill_beside_decodes >= 0, "max_prefill_beside_decodes", "must be >= 0"),
            (
                self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
                "block_size",
                "must be a power of 2",
            ),
            (self.num_kv_blocks >= 0, "num_kv_blocks", "must be >= 0"),
            (0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "must be in (0, 1]"),
            (self.worker_timeout_s > 0, "worker_timeout_s", "must be > 0"),
        ]
        for ok, name, what in checks:
            if not ok:
                raise EngineArgError(name, f"{name} {what}, got {getattr(self, name)!r}")
        if self.generation_config not in ("auto", "vllm") and not Path(self.generation_config).is_dir():
            raise EngineArgError(
                "generation_config",
                f"generation_config must be auto, vllm or a directory, got {self.generation_config!r}",
            )
        if self.speculative_config is not None:  # checked key by key now; the engine builds its record from it
            from coordinator.speculative import SpeculativeConfig, SpeculativeConfigError

            try:
                SpeculativeConfig.from_dict(self.speculative_config)
            except SpeculativeConfigError as e:
                raise EngineArgError("speculative_config", str(e)) from None
        if self.chat_template:  # the template's text from here on, so a missing file fails before start-up
            self.chat_template = _chat_template_text(self.chat_template)
        if self.external_workers and not self.worker_address:
            raise EngineArgError(
                "worker_address", "worker_address is required with external_workers, e.g. tcp://127.0.0.1:29600"
            )
        from settings.env import settings

        self.worker_secret = self.worker_secret or settings().worker_secret or ""
        if self.worker_address and not self.worker_secret and not is_loopback_endpoint(self.worker_address):
            raise EngineArgError(
                "worker_address",
                f"worker_address {self.worker_address!r} is not a loopback address: workers from other hosts must "
                "prove they hold a secret; set NANOSERVE_WORKER_SECRET or --api-key (NANOSERVE_API_KEY), or bind "
                "tcp://127.0.0.1:PORT",
            )

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        return cls(**kwargs)

    def check_local_gpus(self) -> None:
        """Spawned CUDA workers take a GPU each (rank r: cuda:r): too few is refused here, by name, and not by
        a worker's CUDA error after start-up."""
        if self.device != "cuda" or self.external_workers:
            return
        found, tp = cuda_gpu_count(), self.tensor_parallel_size
        if found < tp:
            raise EngineArgError(
                "device" if found == 0 else "tensor_parallel_size",
                f"device 'cuda' with tensor_parallel_size={tp} needs {tp} GPU(s); this machine shows {found} "
                "(CUDA_VISIBLE_DEVICES decides which it shows)",
            )

    def fit_model(self, mc: ModelConfig) -> None:
        """Check these arguments against the model before any worker starts, and resolve ``max_model_len`` (0: the
        model's limit) in place: the value reported is the value enforced."""
        limit = mc.max_position_embeddings
        if self.max_model_len > limit:  # as vLLM: refused, never silently lowered
            raise EngineArgError(
                "max_model_len",
                f"max_model_len={self.max_model_len} is longer than the model's limit: max_position_embeddings="
                f"{limit} in its config.json; pass max_model_len={limit} or less (or 0 for the model's limit)",
            )
        self.max_model_len = self.max_model_len or limit
        tp = self.tensor_parallel_size
        for name, size, what in _tp_sharded_sizes(mc):
            if size % tp:
                raise EngineArgError(
                    "tensor_parallel_size",
                    f"the model's {name}={size} is not divisible by tensor_parallel_size={tp} ({what})",
                )
        kv = mc.num_key_value_heads
        if kv % tp and tp % kv:  # fewer kv heads than ranks: each is replicated on tp / kv ranks
            raise EngineArgError(
                "tensor_parallel_size",
                f"the model's num_key_value_heads={kv} and tensor_parallel_size={tp} do not divide one another: "
                "ranks split the kv heads evenly, or (fewer kv heads than ranks) share each one",
            )

    def worker_config(self, max_model_len: int) -> WorkerConfig:
        """What every worker is told at start-up: each WorkerConfig field of the same name as one of ours is ours,
        by name (a field added to both travels without another line here); the rest are what the engine derives
        (the model's limit) or what only a worker has."""
        from protocol.messages import WorkerConfig

        derived = {
            "max_model_len": max_model_len,
            "num_kv_blocks": self.num_kv_blocks or -1,  # the worker's "size from memory"
            "dist_init_method": "",  # the rendezvous from the environment (torchrun) unless a spawner sets one
            "draft_model": "",  # the engine's: an EAGLE-3 draft once resolved and checked (coordinator/speculative.py)
        }
        return WorkerConfig(
            **{
                f.name: derived[f.name] if f.name in derived else getattr(self, f.name)
                for f in dataclasses.fields(WorkerConfig)
            }
        )


def _tp_sharded_sizes(mc: ModelConfig) -> list[tuple[str, int, str]]:
    """The model sizes tensor parallelism splits evenly (model/linear.py, model/moe.py); the vocabulary is padded to a
    multiple of tp instead (model/layers.py), and kv heads follow their own rule (``fit_model``)."""
    sizes = [("num_attention_heads", mc.num_attention_heads, "each rank takes whole attention heads")]
    layers = range(mc.num_hidden_layers)
    if not all(mc.is_moe_layer(i) for i in layers):  # a dense MLP somewhere
        sizes.append(("intermediate_size", mc.intermediate_size, "each rank takes a slice of the MLP"))
    if any(mc.is_moe_layer(i) for i in layers):
        sizes.append(("moe_intermediate_size", mc.moe_intermediate_size, "each rank takes a slice of every expert"))
    return sizes
