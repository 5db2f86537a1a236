"""NANOSERVE_DECODE_TILES: parsed into the decode tiles the Triton backend takes, or refused naming the variable."""

from __future__ import annotations

import pytest
import torch

from kernels.backends import get_backend
from settings.env import settings


@pytest.mark.parametrize("text, tiles", [("32,1,2,128", (32, 1, 2, 128)), (" 64,4,2 ", (64, 4, 2))])
def test_decode_tiles_reach_the_triton_backend(monkeypatch, text, tiles):
    monkeypatch.setenv("NANOSERVE_DECODE_TILES", text)
    assert settings().decode_tiles == tiles
    assert get_backend("triton", torch.device("cpu")).decode_tiles == tiles


def test_decode_tiles_unset_leave_the_backend_its_policy(monkeypatch):
    monkeypatch.delenv("NANOSERVE_DECODE_TILES", raising=False)
    assert settings().decode_tiles is None
    assert get_backend("triton", torch.device("cpu")).decode_tiles is None


@pytest.mark.parametrize("text", ["abc", "32,1", "32,1,2,128,1", "24,4,2", "8,1,2", "32,3,2", "32,32,2", "32,1,0"])
def test_malformed_decode_tiles_are_refused_by_name(monkeypatch, text):
    monkeypatch.setenv("NANOSERVE_DECODE_TILES", text)
    with pytest.raises(ValueError, match="NANOSERVE_DECODE_TILES"):
        settings()
