"""Small worker helpers: host->device staging and the step-trace summary."""

import numpy as np
import pytest
import torch

from tests.support.timeouts import HANG_S
from worker.step_trace import by_batch, longest_gaps, startup_costs, summarize
from worker.transfer import HostStager, to_device


def test_to_device_converts_on_the_host_and_never_aliases_a_message_buffer():
    buf = np.frombuffer(np.arange(4, dtype="<i4").tobytes(), dtype="<i4")  # read-only, like a decoded message
    t = to_device(buf, torch.device("cpu"))
    assert t.dtype == torch.int64 and t.tolist() == [0, 1, 2, 3]
    t[0] = 7  # writable, and not the message's memory
    assert buf[0] == 0
    f = to_device(np.array([0.5, 1.5]), torch.device("cpu"), torch.float32)
    assert f.dtype == torch.float32 and f.tolist() == [0.5, 1.5]


def test_step_trace_summary_splits_decode_and_prefill_steps():
    rows = [
        {"seqs": 4, "tokens": 300, "busy_ms": 30.0, "gap_ms": 0.0, "wait_ms": 0.0, "launch_ms": 20.0},
        {"seqs": 4, "tokens": 4, "busy_ms": 2.0, "gap_ms": 0.5, "wait_ms": 0.25, "launch_ms": 1.0},
        {"seqs": 4, "tokens": 4, "busy_ms": 4.0, "gap_ms": 1.5, "wait_ms": 1.25, "launch_ms": 2.0},
        # the pause after a warm-up: not idle time
        {"seqs": 4, "tokens": 4, "busy_ms": 3.0, "gap_ms": 5000.0, "wait_ms": 5000.0, "launch_ms": 3.0},
    ]
    text = summarize(rows)
    decode, prefill = text.splitlines()
    assert decode.startswith("decode-only") and "steps     3" in decode
    assert "busy   0.009 s ( 3.000 ms/step)" in decode and "idle before them  0.002 s" in decode
    assert decode.endswith("host launch  2.000 ms/step")
    assert prefill.startswith("with prefill") and "busy   0.030 s" in prefill and "launch 20.000 ms/step" in prefill
    table = by_batch(rows + [{"seqs": 40, "tokens": 40, "busy_ms": 6.0, "gap_ms": 0.0}]).splitlines()
    assert table[1].split() == ["1-32", "3", "3.000", "0.009"] and table[2].split() == ["33-64", "1", "6.000", "0.006"]
    gaps = longest_gaps(rows, n=2).splitlines()  # the warm-up pause is not a gap; listed in step order
    assert gaps == [
        "step     1 (4 seqs, 4 tokens): 0.50 ms idle before it; host waited 0.25 ms for its command, launched it in"
        " 1.00 ms",
        "step     2 (4 seqs, 4 tokens): 1.50 ms idle before it; host waited 1.25 ms for its command, launched it in"
        " 2.00 ms",
    ]


def test_step_trace_lists_the_steps_that_compiled_or_allocated():
    rows = [
        {"seqs": 1, "tokens": 8, "busy_ms": 9.0, "compiled": [], "reserved_mib": 100.0},
        {"seqs": 2, "tokens": 900, "busy_ms": 50.0, "compiled": ["_decode_split_kernel"], "reserved_mib": 100.0},
        {"seqs": 2, "tokens": 2, "busy_ms": 1.0, "compiled": [], "reserved_mib": 164.0},
        {"seqs": 2, "tokens": 2, "busy_ms": 1.0, "compiled": [], "reserved_mib": 164.0},
    ]
    assert startup_costs(rows).splitlines() == [
        "step     1 (2 seqs, 900 tokens, busy 50.00 ms): compiled ['_decode_split_kernel'], reserve +0 MiB",
        "step     2 (2 seqs, 2 tokens, busy 1.00 ms): compiled nothing, reserve +64 MiB",
    ]
    assert startup_costs(rows[:1]).startswith("no step")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_stager_delivers_every_array_across_reused_regions():
    """Regions are reused every third step and arrays are converted while staged; small arrays and arrays that
    overflow the region take pageable copies."""
    dev = torch.device("cuda")
    stager = HostStager(dev, slot_bytes=4096, num_slots=3, inline_bytes=256)
    rng = np.random.default_rng(0)
    sent = []
    for step in range(12):
        stager.begin_step()
        for shape, dtype in [
            ((300,), torch.int64),
            ((7, 33), torch.int32),
            ((5,), torch.float32),
            ((900,), torch.int64),
        ]:
            arr = rng.integers(-1000, 1000, size=shape)
            if step % 2:
                arr = np.frombuffer(arr.tobytes(), dtype=arr.dtype).reshape(shape)  # read-only message view
            sent.append((arr, stager.to_device(arr, dtype), dtype))
        torch.cuda._sleep(1_000_000)  # keep the copies queued behind device work while the host moves on
    torch.cuda.synchronize()
    for arr, got, dtype in sent:
        assert got.dtype == dtype and got.shape == arr.shape
        assert np.array_equal(got.cpu().numpy(), arr.astype(got.cpu().numpy().dtype))


def test_step_loop_reports_finished_steps_before_launching_the_next():
    """With commands queued (a coordinator running ahead), the worker sends a finished step's tokens before it
    launches the next step: the coordinator schedules ahead from them. Real ZMQ sockets, a stub runner."""
    import time

    import zmq

    from protocol.codec import decode, encode
    from protocol.messages import Shutdown
    from tests.support.builders import make_step
    from worker.results import PendingTokens
    from worker.worker import Worker

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    worker = Worker(f"tcp://127.0.0.1:{port}", 0, 1, 0, 0)
    events = []

    class Runner:
        unsettled = None  # no verify step's accepted counts pending

        def launch(self, step):
            events.append(("launch", step.step_id))
            return PendingTokens(step.step_id, None, np.array([step.step_id], np.int32))  # finished at once

    worker.runner = Runner()
    send = worker.send

    def logged_send(msg):
        events.append(("report", msg.step_id))
        send(msg)

    worker.send = logged_send
    try:
        worker.sock.send(b"hello")  # the router learns the worker's identity
        identity, _ = router.recv_multipart()
        for msg in (make_step([dict(slot=0, tokens=[1])], step_id=0), make_step([dict(slot=0, tokens=[2])], 1)):
            router.send_multipart([identity, encode(msg)])
        router.send_multipart([identity, encode(Shutdown("done"))])
        time.sleep(0.2)  # all three messages wait at the worker before its loop starts
        assert worker.step_loop() == 0
        reports = []
        while len(reports) < 2 and router.poll(int(HANG_S * 1000)):  # sent already; a busy host may deliver late
            reports.append(decode(router.recv_multipart()[1]).step_id)
    finally:
        worker.close()
        router.close(0)
        ctx.term()
    assert reports == [0, 1]
    assert events == [("launch", 0), ("report", 0), ("launch", 1), ("report", 1)]
