"""Tensor parallelism on the CPU (gloo): TP=2 greedy tokens equal TP=1 and HF transformers exactly."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.config import EngineArgError
from model.tiny import TinySpec, write_tiny_checkpoint
from nanoserve import LLM, SamplingParams
from tests.support.oracle import hf_greedy, prompts_with_shared_prefixes
from tests.support.processes import ROOT, free_port, torchrun_cmd, wait_for_text
from tests.support.timeouts import HANG_S, START_S, bound


@pytest.fixture(scope="module")
def tiny_one_kv_head(tmp_path_factory) -> Path:
    """One kv head: under tp=2 both ranks hold a replica of it."""
    spec = TinySpec(num_attention_heads=4, num_key_value_heads=1, seed=3)
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_kv1"), spec)


@pytest.mark.parametrize("fixture", ["tiny_tied", "tiny_untied", "tiny_one_kv_head"])
def test_tp2_matches_tp1_and_hf(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    prompts = prompts_with_shared_prefixes()[:8]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = hf_greedy(model_dir, prompts, 12)
    with LLM(str(model_dir), tensor_parallel_size=2, device="cpu", max_model_len=256, num_kv_blocks=96) as llm:
        procs = llm.engine.workers.procs
        assert len(procs) == 2 and len({p.pid for p in procs}) == 2
        got = [c.token_ids for c in llm.generate(prompts, params, use_tqdm=False)]
        assert all(p.poll() is None for p in procs)  # both ranks really ran the whole generation
    assert got == expected
    assert all(p.poll() is not None for p in procs)


def test_tp_that_cannot_divide_heads_is_refused(tiny_tied):
    # 4 q heads cannot split over 3 ranks: refused by name before any worker starts (coordinator/config.py)
    with pytest.raises(EngineArgError, match="num_attention_heads=4 is not divisible by tensor_parallel_size=3"):
        LLM(str(tiny_tied), tensor_parallel_size=3, max_model_len=128, num_kv_blocks=16)


def test_torchrun_worker_group(tiny_untied):
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "tests.tensor_parallel.tp_smoke", "--model", str(tiny_untied), "--tp", "2"]
    out = subprocess.run(cmd, env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=bound(600))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert '"match": true' in out.stdout


def test_tp2_teacher_forced_logits_under_torchrun(tiny_untied):
    cmd = torchrun_cmd(2, "tests.tensor_parallel.tp_logits", "--model", str(tiny_untied))
    env = dict(os.environ)
    out = subprocess.run(cmd, env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=bound(600))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert '"ok": true' in out.stdout


def _external_worker(address: str) -> subprocess.Popen:
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cmd = [sys.executable, "-m", "worker", "--coordinator", address]
    return subprocess.Popen(cmd, env=env, cwd=str(ROOT), stdin=subprocess.DEVNULL)


def test_external_worker_killed_is_detected(tiny_tied):
    """No process handle for a worker started elsewhere: its dropped connection is what tells us."""
    import time

    from protocol.errors import EngineDeadError

    address = f"tcp://127.0.0.1:{free_port()}"
    worker = _external_worker(address)
    try:
        kw = dict(max_model_len=256, num_kv_blocks=32, worker_timeout_s=START_S)
        llm = LLM(str(tiny_tied), external_workers=True, worker_address=address, **kw)
        with llm:
            assert llm.generate("hello", SamplingParams(max_tokens=4), use_tqdm=False)[0].token_ids
            worker.kill()
            worker.wait()
            t0 = time.monotonic()
            with pytest.raises(EngineDeadError):
                llm.generate("hello again", SamplingParams(max_tokens=64, ignore_eos=True), use_tqdm=False)
            assert time.monotonic() - t0 < HANG_S  # the drop is noticed, not the 600 s step timeout
    finally:
        worker.kill()


def test_external_worker_exits_when_its_coordinator_dies(tiny_tied):
    import signal
    import time

    address = f"tcp://127.0.0.1:{free_port()}"
    script = (
        "import sys, time;"
        "from nanoserve import LLM; llm = LLM(sys.argv[1], external_workers=True, worker_address=sys.argv[2],"
        " max_model_len=256, num_kv_blocks=32); print('ready', flush=True); time.sleep(600)"
    )
    env = dict(os.environ)
    coordinator = subprocess.Popen(
        [sys.executable, "-c", script, str(tiny_tied), address], env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    worker = _external_worker(address)
    try:
        assert coordinator.stdout.readline().strip() == "ready"
        coordinator.send_signal(signal.SIGKILL)
        coordinator.wait()
        t0 = time.monotonic()
        worker.wait(timeout=HANG_S)  # it notices the lost connection; this stops only a hang
        assert time.monotonic() - t0 < HANG_S
    finally:
        coordinator.kill()
        worker.kill()


def test_start_names_the_ranks_that_never_joined(tiny_tied, tmp_path):
    """tp=2 with external workers, but only rank 0 is started: the start fails, naming rank 1. Rank 0 has queued
    its hello before the coordinator starts (it says it is waiting), so the short start-up timeout only ever
    waits for the rank that never comes, however slowly this machine starts processes."""
    address = f"tcp://127.0.0.1:{free_port()}"
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    log = tmp_path / "worker.log"
    with open(log, "w") as stderr:
        cmd = [sys.executable, "-m", "worker", "--coordinator", address]
        worker = subprocess.Popen(cmd, env=env, cwd=str(ROOT), stdin=subprocess.DEVNULL, stderr=stderr)
    try:
        wait_for_text(log, f"waiting for the coordinator at {address}", worker)
        with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\]"):
            LLM(
                str(tiny_tied),
                tensor_parallel_size=2,
                external_workers=True,
                worker_address=address,
                worker_timeout_s=3,
                max_model_len=128,
                num_kv_blocks=16,
            )
        assert worker.wait(timeout=HANG_S) != 0  # told to stop (or lost its coordinator): it does not linger
    finally:
        worker.kill()


def test_worker_without_a_coordinator_says_where_it_waits_and_gives_up(tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    cmd = [sys.executable, "-m", "worker", "--coordinator", address, "--connect-timeout", "2"]
    out = subprocess.run(
        cmd, env=env, cwd=str(ROOT), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 1, out.stderr
    lines = out.stderr.splitlines()
    waiting = f"worker rank 0: waiting for the coordinator at {address}"
    gave_up = (
        f"worker rank 0: error: no coordinator answered at {address} within 2 s; is it running, and can this host "
        "reach that address? (wait longer with --connect-timeout)"
    )
    assert waiting in lines and gave_up in lines and lines.index(waiting) < lines.index(gave_up), out.stderr
