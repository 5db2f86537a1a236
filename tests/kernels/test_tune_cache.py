"""The start-up choices kept across starts (kernels/tune_cache.py): written once, read back by a later process with
the same key, recomputed (never trusted, never a crash) when the key differs, the file is corrupt or foreign, an
entry fails its check, or the directory was deleted or cannot be written. On a GPU, the real cuBLASLt tuner makes
the same choices from the cache without timing anything."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from kernels.tune_cache import TuneCache, code_hash
from tests.support.processes import ROOT
from tests.support.timeouts import HANG_S

KEY = {"gpu": "Fake GPU 80GB", "driver": "570.1", "torch": "2.11", "code": "abc"}


class Tuner:
    """A fake tuning: counts how often it really "times" something."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> dict:
        self.calls += 1
        return {"best_us": 12.5, "algo": "00ff" * 4}


def _tune(root, key=KEY, names=("16x4096x4096", "32x4096x4096"), valid=None) -> tuple[Tuner, TuneCache]:
    """One "start": look every product up (timing the missing ones), then save."""
    tuner, cache = Tuner(), TuneCache("fake", key, root=root)
    for name in names:
        value = cache.lookup(name, tuner, valid) if valid else cache.lookup(name, tuner)
        assert value == {"best_us": 12.5, "algo": "00ff" * 4}
    cache.save()
    return tuner, cache


def test_a_second_start_reads_what_the_first_wrote(tmp_path):
    first, cache = _tune(tmp_path)
    assert first.calls == 2 and cache.path.is_file() and cache.path.parent == tmp_path / "fake"
    second, cache = _tune(tmp_path)
    assert second.calls == 0 and (cache.hits, cache.misses) == (2, 0)
    third, _ = _tune(tmp_path, names=("16x4096x4096", "64x4096x4096"))  # a new product only: only it is timed
    assert third.calls == 1


def test_the_cache_is_read_by_another_process(tmp_path):
    _tune(tmp_path)
    code = (
        "import sys; from pathlib import Path; from kernels.tune_cache import TuneCache; "
        f"c = TuneCache('fake', {KEY!r}, root=Path(sys.argv[1])); "
        "print(sorted(c.entries))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=HANG_S)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['16x4096x4096', '32x4096x4096']"


@pytest.mark.parametrize("field", ["gpu", "driver", "torch", "code"], ids=lambda f: f"key-{f}")  # not "gpu": a marker
def test_any_key_change_recomputes(tmp_path, field):
    _tune(tmp_path)
    tuner, _ = _tune(tmp_path, key={**KEY, field: KEY[field] + "-other"})
    assert tuner.calls == 2
    again, _ = _tune(tmp_path)  # the first key's file is still there, untouched
    assert again.calls == 0


@pytest.mark.parametrize(
    "content",
    [b"", b"{not json", b"\xff\xfe\x00garbage", b"[1, 2, 3]", b'{"key": null}', b'{"entries": {"16x4096x4096": 1}}'],
)
def test_a_corrupt_file_recomputes_and_is_rewritten(tmp_path, content):
    _, cache = _tune(tmp_path)
    cache.path.write_bytes(content)
    tuner, cache = _tune(tmp_path)
    assert tuner.calls == 2
    assert json.loads(cache.path.read_text())["key"] == cache.key  # whole again
    assert _tune(tmp_path)[0].calls == 0


def test_a_foreign_file_under_our_name_is_not_trusted(tmp_path):
    """A file whose stored key is another's (copied from another machine, renamed): recomputed, overwritten."""
    _, cache = _tune(tmp_path)
    data = json.loads(cache.path.read_text())
    data["key"]["gpu"] = "Another GPU"
    data["entries"]["16x4096x4096"]["algo"] = "bad"
    cache.path.write_text(json.dumps(data))
    tuner, cache = _tune(tmp_path)
    assert tuner.calls == 2
    assert json.loads(cache.path.read_text())["key"]["gpu"] == KEY["gpu"]


def test_an_entry_that_fails_its_check_is_recomputed(tmp_path):
    _tune(tmp_path)
    checked = []

    def valid(entry: dict) -> bool:
        checked.append(entry)
        if len(checked) == 1:
            return False  # e.g. the library refuses the stored algorithm
        raise ValueError("a damaged entry")  # any error while checking: not usable either

    tuner, cache = _tune(tmp_path, valid=valid)
    assert tuner.calls == 2 and cache.misses == 2 and len(checked) == 2
    assert _tune(tmp_path, valid=lambda e: True)[0].calls == 0  # rewritten by the recomputation


def test_deleting_the_cache_dir_is_safe(tmp_path):
    root = tmp_path / "cache"
    _tune(root)
    subprocess.run(["rm", "-rf", str(root)], check=True)
    tuner, cache = _tune(root)
    assert tuner.calls == 2 and cache.path.is_file()


def test_an_unwritable_cache_dir_costs_the_saving_not_the_start(tmp_path, capfd):
    root = tmp_path / "a-file"  # where the cache dir should be: no directory can be made there (as root too)
    root.write_text("not a directory")
    tuner, cache = _tune(root)
    assert tuner.calls == 2 and not cache.path.exists()
    assert "cannot write the tuning cache" in capfd.readouterr().err
    assert _tune(root)[0].calls == 2  # and every start still runs


def test_the_code_hash_follows_the_source(tmp_path, monkeypatch):
    import types

    module = types.ModuleType("tuner_v")
    module.__file__ = str(tmp_path / "tuner_v.py")
    (tmp_path / "tuner_v.py").write_text("A = 1\n")
    before = code_hash([module])
    assert code_hash([module]) == before
    (tmp_path / "tuner_v.py").write_text("A = 2\n")
    assert code_hash([module]) != before


@pytest.mark.gpu
def test_the_real_tuner_reads_its_choices_back(tmp_path):
    """Two tunings of the same products against one cache dir: the second times nothing and chooses the same."""
    import torch

    from kernels import cublaslt_tune
    from worker.cuda_graphs import batch_buckets

    g = torch.Generator(device="cuda").manual_seed(0)
    weights = {(n, k): [torch.randn(n, k, device="cuda", generator=g).bfloat16() for _ in range(4)]
               for n, k in ((3072, 4096), (4096, 2048))}  # fmt: skip
    rows = batch_buckets(64)
    key = cublaslt_tune.cache_key(torch.device("cuda"))
    runs = []
    for _ in range(2):
        cublaslt_tune._chosen.clear()
        cache = TuneCache("cublaslt", key, root=tmp_path)
        records = cublaslt_tune.tune(weights, rows, cache=cache)
        runs.append((cache.hits, cache.misses, [r.config for r in records], dict(cublaslt_tune._chosen)))
    (h1, m1, configs1, chosen1), (h2, m2, configs2, chosen2) = runs
    assert (h1, m1) == (0, len(configs1)) and (h2, m2) == (len(configs1), 0)
    assert configs1 == configs2
    assert {k: bytes(v) for k, v in chosen1.items()} == {k: bytes(v) for k, v in chosen2.items()}
    cublaslt_tune._chosen.clear()


def test_a_time_budget_leaves_the_rest_for_a_later_start(tmp_path, monkeypatch):
    """The real ``tune`` loop on CPU tensors, its timing replaced by a clock that each timing moves 1 s: a 2.5 s
    budget times three products (the largest row counts first) and stores only them; the next start reads those
    back and times exactly the ones left."""
    import torch

    from kernels import cublaslt_tune

    clock = [0.0]
    timed: list[int] = []

    def fake_time_product(x, ws, min_gain):
        clock[0] += 1.0
        timed.append(x.shape[0])
        return {"torch_us": 10.0, "best_us": 10.0, "algo": None}

    monkeypatch.setattr(cublaslt_tune, "_time_product", fake_time_product)
    monkeypatch.setattr(cublaslt_tune, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    weights = {(8, 4): [torch.zeros(8, 4)], (4, 8): [torch.zeros(4, 8)]}
    rows = [1, 2, 4, 8]
    first = TuneCache("cublaslt", KEY, root=tmp_path)
    records = cublaslt_tune.tune(weights, rows, cache=first, budget_s=2.5)
    assert timed == [8, 8, 4] and len(records) == 3
    assert (first.hits, first.misses, first.deferred) == (0, 3, 5)
    timed.clear()
    second = TuneCache("cublaslt", KEY, root=tmp_path)
    records = cublaslt_tune.tune(weights, rows, cache=second)
    assert timed == [4, 2, 2, 1, 1] and len(records) == 8
    assert (second.hits, second.misses, second.deferred) == (3, 5, 0)
