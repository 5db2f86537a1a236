import atexit
import os
import shutil
import signal
import tempfile
import warnings
from pathlib import Path

import pytest

# OpenMP threads that finish a parallel region spin for a while before sleeping; on a 2-core host shared by two test
# processes, their engines' workers and other jobs, the spinners take the cores the others wait for (a tiny
# model's HF generate went from 1.3 s to 28 s). Read when libgomp loads, so before torch; subprocesses inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from model.tiny import TinySpec, write_tiny_checkpoint

# Without CUDA, Triton kernels run in its interpreter (CPU tensors). The switch is read when a kernel is
# decorated, so it must be on before any test module imports one (model.tiny imports none).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# What nanoserve keeps across starts (tokenizer classes, cuBLASLt choices, benchmark shapes) goes to one directory
# for the test session, never the user's ~/.cache/nanoserve; it is removed by the process that made it (xdist's
# workers inherit the variable and share it).
if "NANOSERVE_CACHE" not in os.environ:
    os.environ["NANOSERVE_CACHE"] = tempfile.mkdtemp(prefix="nanoserve-test-cache-")
    atexit.register(shutil.rmtree, os.environ["NANOSERVE_CACHE"], ignore_errors=True)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped without it")


# The files that take longest, longest first (a loaded 2-core run's --durations, summed per file). The suite runs
# whole files on two processes (pytest -n 2 --dist loadfile, in collection order: --no-loadscope-reorder), so these
# start first and the many short files fill in behind them, instead of one long file running alone at the end.
# A file not named keeps its place after them; the order only schedules, every test still runs.
SLOW_FILES = (
    "tests/engine/test_speculative_eagle3.py",
    "tests/kernels/test_triton_kernels.py",
    "tests/model/test_families.py",
    "tests/engine/test_speculative.py",
    "tests/kernels/test_moe_decode.py",
    "tests/kernels/test_fp8_kv.py",
    "tests/serving/test_serving.py",
    "tests/engine/test_structured_outputs.py",
    "tests/tensor_parallel/test_tp.py",
    "tests/engine/test_e2e_parity.py",
    "tests/engine/test_engine_validation.py",
    "tests/engine/test_offline_api.py",
    "tests/kernels/test_fp8_gemm.py",
    "tests/kernels/test_fused_moe.py",
    "tests/serving/test_openai_server.py",
    "tests/cli/test_nanoserve_command.py",
    "tests/serving/test_fairness.py",
    "tests/model/test_default_model.py",
    "tests/model/test_weight_stream.py",
    "tests/serving/test_lifecycle.py",
    "tests/model/test_moe.py",
    "tests/cli/test_soak.py",
    "tests/serving/test_async_client.py",
    "tests/cli/test_documented_commands.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(SLOW_FILES)))  # stable: others keep order
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _os_signal_state() -> dict[str, bool]:
    """Whether SIGINT and SIGTERM are ignored or blocked as the kernel sees it: C code (a library, ctypes) can change
    that where Python's ``signal.getsignal`` does not see it, and a subprocess inherits exactly this."""
    bits = sum(1 << (s - 1) for s in _SIGNALS)
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("SigIgn", "SigBlk")))
    except OSError:
        return {}
    return {name: bool(int(value, 16) & bits) for name, value in fields.items()}


@pytest.fixture(autouse=True)
def _signal_handling_restored():
    """Code run in this process (a main() under test, a server's own handlers) must not leave its signal handling
    to later tests: their subprocesses inherit an ignored or blocked SIGINT and never stop on Ctrl-C. Put back, and
    named in a warning."""
    handlers = {s: signal.getsignal(s) for s in _SIGNALS}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    os_state = _os_signal_state()
    yield
    for s, handler in handlers.items():
        if signal.getsignal(s) is not handler:
            warnings.warn(f"the test left {signal.Signals(s).name} handled by {signal.getsignal(s)!r}", stacklevel=1)
            signal.signal(s, handler)
    if signal.pthread_sigmask(signal.SIG_SETMASK, mask) != mask:
        warnings.warn("the test left signals blocked", stacklevel=1)
    if (after := _os_signal_state()) != os_state:
        warnings.warn(f"the test changed SIGINT/SIGTERM ignored/blocked from {os_state} to {after}", stacklevel=1)


@pytest.fixture(scope="session")
def tiny_tied(tmp_path_factory) -> Path:
    """Tied embeddings, GQA 4 q heads / 2 kv heads."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_tied"), TinySpec(tie_word_embeddings=True, seed=1))


@pytest.fixture(scope="session")
def tiny_untied(tmp_path_factory) -> Path:
    """Untied LM head, odd vocabulary size, 2 kv heads, 3 layers."""
    spec = TinySpec(tie_word_embeddings=False, vocab_size=509, num_hidden_layers=3, seed=2)
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_untied"), spec)
