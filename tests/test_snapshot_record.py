"""Snapshots, the recording side (issue 21): a record written while its writer is SIGKILLed is whole or absent;
a live process's evidence survives the trip to JSON and back, field by field, and is judged alike;
``probe PID snapshot`` and ``probe MASTER:PORT snapshot`` record, ``probe snapshots DIR`` lists."""

import dataclasses
import json
import os
import random
import signal
import stat
import subprocess
import sys
import time

import pytest

from procs import REPO, scaled, spawn, target_env

_WRITER = r"""
import sys
from probe.snapshot import record
d = sys.argv[1]
n = 0
print("START", flush=True)
while True:
    n += 1
    filler = "%08d" % n * 150000  # 1.2 MB, all of one number
    rec = record.new_record("job", 3, "h", 1, "test", 0.0, [{"rank": 3}, {"rank": 3}])
    rec["tables"]["filler"] = {"columns": [["x", "VARCHAR"]], "rows": [[filler]], "truncated": False}
    rec["n"] = n
    record.write_rank(d, rec)
"""


def test_a_record_written_while_its_writer_is_sigkilled_is_whole_or_absent(tmp_path):
    from probe.snapshot import record

    seen_whole = 0
    rng = random.Random(21)
    for attempt in range(8):
        directory = tmp_path / ("s%d" % attempt)
        directory.mkdir()
        child = subprocess.Popen([sys.executable, "-c", _WRITER, str(directory)], stdout=subprocess.PIPE,
                                 env=target_env(probe=False), cwd=REPO)
        try:
            assert child.stdout.readline().strip() == b"START"
            time.sleep(rng.uniform(0.0, 0.25))
            child.send_signal(signal.SIGKILL)
            child.wait(scaled(10))
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(10)
            child.stdout.close()
        path = directory / record.rank_file_name(3)
        if not path.exists():
            continue
        rec = record.read_rank(str(path))  # raises on half a file
        filler = rec["tables"]["filler"]["rows"][0][0]
        assert filler == "%08d" % rec["n"] * 150000
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        seen_whole += 1
    assert seen_whole >= 1, "no kill came after a whole write: the test proved nothing"

    last = next(p for p in sorted(tmp_path.glob("s*/" + record.rank_file_name(3))))
    cut = tmp_path / "cut.json"
    cut.write_bytes(last.read_bytes()[:1000])
    with pytest.raises(Exception) as raised:
        record.read_rank(str(cut))
    assert "cut short or not JSON" in str(raised.value)


def test_a_live_process_evidence_round_trips_and_is_judged_alike():
    from probe.client import connect
    from probe.diagnose.evidence import Sample, collect
    from probe.diagnose.rules import judge
    from probe.snapshot import record

    proc = spawn("grad_loop.py", timeout=60)
    try:
        client = connect(str(proc.pid))
        looks = []
        for _ in range(2):
            looks.append(collect(client, 0, "h", proc.pid))
            time.sleep(1.0)
    finally:
        proc.kill()
    back = [record.evidence_from_json(json.loads(json.dumps(record.evidence_to_json(ev)))) for ev in looks]
    for ev, again in zip(looks, back):
        assert ev.state == "answering" and ev.frames and ev.steps and ev.memory["readings"]
        for f in dataclasses.fields(ev):
            if f.name != "error":
                assert getattr(again, f.name) == getattr(ev, f.name), f.name
        assert again.stacks() == ev.stacks()

    def cmd(ranks, rest):
        return "probe T " + rest

    live = judge(Sample({0: looks[0]}, 1, True, looks[0].at), Sample({0: looks[1]}, 1, True, looks[1].at), cmd)
    kept = judge(Sample({0: back[0]}, 1, True, back[0].at), Sample({0: back[1]}, 1, True, back[1].at), cmd)
    assert kept.as_json() == live.as_json()
    assert live.status == "healthy", live.as_json()
