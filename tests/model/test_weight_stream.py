"""model/weight_stream.py, model/checkpoint_plan.py and model/safetensors_reader.py on real safetensors files: our
readers fill every parameter bit for bit as safetensors' own reader does (every family, MoE, block FP8, 16-bit
targets, a sharded checkpoint with its index, TP=2 ranks), a rank reads only its rows, and truncated or corrupt
files are refused naming the file and the tensor."""

from __future__ import annotations

import json
import struct
from contextlib import closing
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from comm.parallel import set_tp
from model import weight_stream
from model.checkpoint_plan import CheckpointPlan
from model.config import ModelConfig
from model.loader import build_model, checkpoint_files, load_model, load_weights, plan_pieces
from model.safetensors_reader import read_header
from model.tiny import TinySpec, write_tiny_checkpoint
from tests.model.test_families import FAMILIES
from tests.support.fp8_checkpoints import write_block_fp8
from tests.support.tiny_moe import TinyMoeSpec, write_tiny_moe_checkpoint

CPU = torch.device("cpu")
OURS = ("staged", "mmap")  # the CUDA path's logic (reader thread, chunks, staging) runs on the CPU too
FP8_SPEC = TinySpec(hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=2, head_dim=128)


@pytest.fixture(autouse=True)
def poison_unread_rows(monkeypatch):
    """Rows a rank does not read hold 0xFF bytes (NaN in bf16/fp32), never stale memory that might match."""
    monkeypatch.setattr(weight_stream, "UNREAD_FILL", 0xFF)
    monkeypatch.setattr(weight_stream, "CHUNK", 4096)  # tensors span many chunks and buffers are reused
    monkeypatch.setattr(weight_stream, "PREFETCH", 8192)
    monkeypatch.setattr(weight_stream, "READ_AHEAD", 3 * 4096)


@pytest.fixture
def tp2():
    yield lambda rank: set_tp(rank, 2)
    set_tp(0, 1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> checkpoint dir, written on first use."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            base = tmp_path_factory.mktemp(name)
            if name in FAMILIES:
                made[name] = write_tiny_checkpoint(base, FAMILIES[name])
            elif name == "moe":
                made[name] = write_tiny_moe_checkpoint(base, TinyMoeSpec(seed=4))
            elif name == "fp8":
                made[name] = write_block_fp8(write_tiny_checkpoint(base / "f32", FP8_SPEC), base)[0]
            else:
                made[name] = write_tiny_checkpoint(base, TinySpec(dtype="bfloat16", tie_word_embeddings=False))
        return made[name]

    return get


def params_bytes(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().reshape(-1).view(torch.uint8).clone() for n, p in model.named_parameters()}


def assert_same_bits(model_dir: Path, dtype: torch.dtype, reader: str, quantization: str = "") -> None:
    ref = params_bytes(_load(model_dir, dtype, "safetensors", quantization))
    got = params_bytes(_load(model_dir, dtype, reader, quantization))
    assert got.keys() == ref.keys()
    for name in ref:
        assert torch.equal(got[name], ref[name]), name


def _load(model_dir: Path, dtype: torch.dtype, reader: str, quantization: str = "", device: torch.device = CPU):
    return load_model(model_dir, device, dtype, quantization=quantization, reader=reader)


# ---- the same bits as safetensors' own reader ------------------------------------------------------------------


@pytest.mark.parametrize("reader", OURS)
@pytest.mark.parametrize("name", [*FAMILIES, "moe", "fp8", "bf16"])
def test_bit_equal_to_safetensors(checkpoints, name, reader):
    assert_same_bits(checkpoints(name), torch.float32, reader)


@pytest.mark.parametrize("reader", OURS)
@pytest.mark.parametrize("name", ["qwen3", "bf16"])
def test_bit_equal_into_16_bit_models(checkpoints, name, reader):
    """A float32 checkpoint cast to bf16 at load (the copy rounds), bf16 into fp16, and quantized to FP8 at load."""
    assert_same_bits(checkpoints(name), torch.bfloat16, reader)
    assert_same_bits(checkpoints(name), torch.float16, reader)
    assert_same_bits(checkpoints(name), torch.bfloat16, reader, quantization="fp8")


@pytest.mark.parametrize("reader", OURS)
@pytest.mark.parametrize("name", ["llama", "qwen2", "moe", "fp8", "bf16"])
def test_tp2_ranks_bit_equal_and_read_only_their_rows(checkpoints, name, reader, tp2):
    model_dir = checkpoints(name)
    total = sum(e.nbytes for f in checkpoint_files(model_dir) for e in read_header(f))
    for rank in (0, 1):
        tp2(rank)
        assert_same_bits(model_dir, torch.float32, reader)
        model = _load(model_dir, torch.float32, "safetensors")
        read = sum(p.nbytes for p in plan_pieces(CheckpointPlan(model), checkpoint_files(model_dir)))
        # column-parallel rows (q/k/v, gate/up, vocabulary, experts' gate/up) are read in halves; the rest whole
        assert read < 0.8 * total, (rank, read, total)


@pytest.mark.parametrize("rank", [0, 1])
def test_read_ahead_asks_for_exactly_the_planned_bytes(checkpoints, rank, tp2, monkeypatch):
    """The kernel is asked (WILLNEED) for every byte this rank reads and for no byte of the other rank's rows."""
    import os

    model_dir = checkpoints("llama")  # several files
    tp2(rank)
    model = _load(model_dir, torch.float32, "safetensors")
    pieces = plan_pieces(CheckpointPlan(model), checkpoint_files(model_dir))
    asked: dict[int, set[int]] = {}
    paths: dict[int, Path] = {}
    real_open, real_advise = os.open, os.posix_fadvise

    def track_open(path, *args):
        fd = real_open(path, *args)
        paths[fd] = Path(path)
        return fd

    def track_advise(fd, offset, length, advice):
        if advice == os.POSIX_FADV_WILLNEED:
            asked.setdefault(paths[fd], set()).update(range(offset, offset + length))
        real_advise(fd, offset, length, advice)

    monkeypatch.setattr(weight_stream.os, "open", track_open)
    monkeypatch.setattr(weight_stream.os, "posix_fadvise", track_advise)
    with closing(weight_stream.stream(pieces, CPU, staged=True)) as tensors:
        assert sum(1 for _ in tensors) == len(pieces)
    planned: dict[Path, set[int]] = {}
    for p in pieces:
        start = p.entry.start + p.byte_lo
        planned.setdefault(p.path, set()).update(range(start, start + p.nbytes))
    assert asked == planned


def test_sharded_checkpoint_reads_every_file(checkpoints):
    model_dir = checkpoints("llama")  # max_shard_size 300KB: several files and model.safetensors.index.json
    files = checkpoint_files(model_dir)
    assert len(files) > 1 and (model_dir / "model.safetensors.index.json").is_file()
    model = _load(model_dir, torch.float32, "safetensors")
    assert {p.path for p in plan_pieces(CheckpointPlan(model), files)} == set(files)
    assert_same_bits(model_dir, torch.float32, "staged")


def test_pieces_in_file_order(checkpoints):
    model_dir = checkpoints("qwen3")
    model = _load(model_dir, torch.float32, "safetensors")
    pieces = plan_pieces(CheckpointPlan(model), checkpoint_files(model_dir))
    keys = [(p.path, p.entry.start) for p in pieces]
    assert keys == sorted(keys) and len(keys) == len(set(keys))


def test_load_model_default_reader_is_ours(checkpoints):
    model_dir = checkpoints("qwen3")
    got = params_bytes(load_model(model_dir, CPU, torch.float32))
    ref = params_bytes(_load(model_dir, torch.float32, "safetensors"))
    assert all(torch.equal(got[n], ref[n]) for n in ref)
    with pytest.raises(ValueError, match="reader: unsupported value 'fast'"):
        load_weights(build_model(ModelConfig.from_pretrained(model_dir), CPU, torch.float32), model_dir, "fast")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3", "moe", "fp8", "bf16"])
def test_gpu_pinned_async_copies_bit_equal(checkpoints, name, tp2):
    """CUDA's own path (pinned buffers reused after their copy's event, copies on the stream, cuts on the device)
    at TP 1 and as each TP 2 rank, into bf16 and float32 models."""
    model_dir, cuda = checkpoints(name), torch.device("cuda")
    for rank, size in ((0, 1), (0, 2), (1, 2)):
        set_tp(rank, size)
        online_fp8 = [(torch.bfloat16, "fp8")] if name in ("qwen3", "bf16") else []
        for dtype, quant in [(torch.float32, ""), (torch.bfloat16, ""), *online_fp8]:
            ref = params_bytes(_load(model_dir, dtype, "safetensors", quant, cuda))
            got = params_bytes(_load(model_dir, dtype, "auto", quant, cuda))
            assert got.keys() == ref.keys()
            for n in ref:
                assert torch.equal(got[n], ref[n]), (rank, size, dtype, quant, n)


# ---- truncated and corrupt files ---------------------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    return Path(shutil.copytree(src, dst))


def _last_tensor(path: Path):
    return max(read_header(path), key=lambda e: e.start)


@pytest.mark.parametrize("reader", [*OURS, "auto", "safetensors"])
def test_truncated_file_names_file_and_tensor(checkpoints, tmp_path, reader):
    d = _copy(checkpoints("qwen3"), tmp_path / "m")
    f = d / "model.safetensors"
    last = _last_tensor(f)
    with open(f, "r+b") as fh:
        fh.truncate(last.start + last.nbytes // 2)
    with pytest.raises(ValueError, match="truncated") as e:
        load_model(d, CPU, torch.float32) if reader == "auto" else _load(d, torch.float32, reader)
    assert str(f) in str(e.value) and repr(last.name) in str(e.value)


@pytest.mark.parametrize("reader", OURS)
def test_file_truncated_while_loading_names_file_and_tensor(checkpoints, tmp_path, reader):
    """The header said the bytes were there; the file shrank before they were read."""
    d = _copy(checkpoints("qwen3"), tmp_path / "m")
    f = d / "model.safetensors"
    model = build_model(ModelConfig.from_pretrained(d), CPU, torch.float32)
    pieces = plan_pieces(CheckpointPlan(model), [f])
    last = _last_tensor(f)
    with open(f, "r+b") as fh:
        fh.truncate(last.start + 10)
    with pytest.raises(ValueError, match="truncated while loading") as e:
        with closing(weight_stream.stream(pieces, CPU, staged=reader == "staged")) as tensors:
            for _ in tensors:
                pass
    assert str(f) in str(e.value) and repr(last.name) in str(e.value)


def _write_raw(path: Path, header: bytes, data: bytes = b"") -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def test_corrupt_headers_name_the_file_and_tensor(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="too short for the header length"):
        read_header(f)
    f.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ValueError, match=r"not a safetensors file or truncated: header of \d+ bytes"):
        read_header(f)
    _write_raw(f, b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]')
    with pytest.raises(ValueError, match="header is not valid JSON") as e:
        read_header(f)
    assert str(f) in str(e.value)
    bad_entries = {
        "'w': unsupported dtype 'F4'": {"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}},
        "'w': byte range 0..6 does not hold shape": {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 6]}},
        "'w': malformed header entry": {"w": {"dtype": "F32", "shape": [2]}},
        "'b': its bytes overlap those of tensor 'a'": {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
        },
    }
    for message, header in bad_entries.items():
        _write_raw(f, json.dumps(header).encode(), bytes(16))
        with pytest.raises(ValueError, match=f"tensor {message}") as e:
            read_header(f)
        assert str(f) in str(e.value)


def test_corrupt_file_in_a_model_is_named(checkpoints, tmp_path):
    d = _copy(checkpoints("qwen3"), tmp_path / "m")
    f = d / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[12:20] = b"\xff" * 8  # inside the JSON header
    f.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="header is not valid JSON") as e:
        load_model(d, CPU, torch.float32)
    assert str(f) in str(e.value)


def test_header_matches_safetensors_for_every_dtype(tmp_path):
    tensors = {
        n: torch.arange(6).reshape(2, 3).to(dt)
        for n, dt in [("f", torch.float32), ("h", torch.float16), ("b", torch.bfloat16), ("q", torch.float8_e4m3fn)]
    }
    tensors["i"] = torch.arange(5, dtype=torch.int64)
    tensors["s"] = torch.tensor(3.5)
    save_file(tensors, tmp_path / "x.safetensors")
    entries = {e.name: e for e in read_header(tmp_path / "x.safetensors")}
    assert {n: (e.dtype, e.shape) for n, e in entries.items()} == {
        n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()
    }
    raw = (tmp_path / "x.safetensors").read_bytes()
    for n, t in tensors.items():
        e = entries[n]
        got = torch.frombuffer(bytearray(raw[e.start : e.start + e.nbytes]), dtype=torch.uint8)
        assert torch.equal(got, t.reshape(-1).view(torch.uint8)), n
