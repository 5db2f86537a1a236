import os
from pathlib import Path

import pytest
import torch

from model.tiny import TinySpec, write_tiny_checkpoint

# Without CUDA, Triton kernels run in its interpreter (CPU tensors). The switch is read when a kernel is
# decorated, so it must be on before any test module imports one (model.tiny imports none).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped without it")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_tied(tmp_path_factory) -> Path:
    """Tied embeddings, GQA 4 q heads / 2 kv heads."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_tied"), TinySpec(tie_word_embeddings=True, seed=1))


@pytest.fixture(scope="session")
def tiny_untied(tmp_path_factory) -> Path:
    """Untied LM head, odd vocabulary size, 2 kv heads, 3 layers."""
    spec = TinySpec(tie_word_embeddings=False, vocab_size=509, num_hidden_layers=3, seed=2)
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_untied"), spec)
