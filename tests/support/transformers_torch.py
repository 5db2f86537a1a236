"""Whether this transformers loads torch with its fast tokenizer class: 5.17 does (tokenization_utils_tokenizers
imports its GGUF helpers, which import torch), 5.24 does not. Where it does, no tokenizer load of ours is torch-free."""

from __future__ import annotations

import functools
import subprocess
import sys

from tests.support.timeouts import START_S


@functools.cache
def tokenizer_import_loads_torch() -> bool:
    probe = "import sys; from transformers import PreTrainedTokenizerFast; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=START_S, check=True)
    return out.stdout.strip().endswith("True")
