"""What a GPU benchmark checks right after its arguments: enough CUDA devices, or one line saying so."""

from __future__ import annotations

import sys


def require_cuda(gpus: int = 1) -> None:
    """Exit at once (status 1, one line on stderr) unless this machine has ``gpus`` CUDA devices."""
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < gpus:
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        name = spec.name if spec else sys.argv[0]
        sys.exit(f"{name} needs {gpus} CUDA GPU{'s' if gpus > 1 else ''}; this machine has {found}")
