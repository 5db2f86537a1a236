"""benchmarks/schedule_step.py: the real scheduler decodes every sequence every step under async scheduling
(the probe asserts it for each timed step), and the probe reports its JSON."""

import json

from benchmarks.schedule_step import main


def test_the_probe_times_decode_steps_of_every_sequence(capsys):
    res = main(["--seqs", "24", "--steps", "40"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == res and res["seqs"] == 24 and res["steps"] == 40
    assert res["ms_per_step"] > 0 and abs(res["us_per_seq"] * 24 - res["ms_per_step"] * 1e3) < 1e-6
