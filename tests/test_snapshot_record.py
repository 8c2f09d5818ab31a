"""Snapshots, the recording side (issue 21): a record written while its writer is SIGKILLed is whole or absent;
a live process's evidence survives the trip to JSON and back, field by field, and is judged alike;
``probe PID snapshot`` and ``probe MASTER:PORT snapshot`` record, ``probe snapshots DIR`` lists."""

import dataclasses
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest

from procs import REPO, run_cli, scaled, spawn, target_env
from test_cluster import needs_torchrun, torchrun_job

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
    from probe.diagnose.evidence import Sample
    from probe.diagnose.gather import collect
    from probe.diagnose.rules import judge
    from probe.snapshot import record

    proc = spawn("grad_loop.py", timeout=60)
    try:
        client = connect(str(proc.pid))
        looks = []
        for _ in range(2):
            looks.append(collect(client, 0, "h", proc.pid))
            time.sleep(1.0)
        from probe.snapshot.capture import capture_rank

        # A record taken in a process that looked before (the node helper's watch) keeps only its own readings.
        rec = capture_rank(client, 0, "h", proc.pid, "test", "j")
        assert [len(e["memory"]["readings"]) for e in rec["evidence"]] == [1, 2], rec["evidence"]
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


def _modes(directory):
    """Every file's and directory's mode under ``directory`` (itself included)."""
    out = {str(directory): stat.S_IMODE(os.stat(directory).st_mode)}
    for base, dirs, files in os.walk(directory):
        for name in dirs + files:
            out[os.path.join(base, name)] = stat.S_IMODE(os.stat(os.path.join(base, name)).st_mode)
    return out


def test_snapshot_of_a_pid_then_snapshots_lists_it(tmp_path):
    root = tmp_path / "snaps"
    empty = run_cli("snapshots", str(root))
    assert empty.code == 0 and "no snapshot in %s" % root in empty.out and "probe TARGET snapshot" in empty.out
    proc = spawn("secret_locals.py", ["--password", "s3cr3t-on-argv"])
    try:
        made = run_cli(str(proc.pid), "snapshot", "--dir", str(root), timeout=scaled(60))
    finally:
        proc.kill()
    assert made.code == 0, made.err
    (snap,) = os.listdir(root)
    assert snap.startswith("pid%d-" % proc.pid) and "snapshot %s written to %s" % (snap, root / snap) in made.out
    assert "recorded: rank 0 (1 of 1)" in made.out
    assert sorted(os.listdir(root / snap)) == ["meta-%s.json" % os.uname().nodename, "rank-00000.json"]
    modes = _modes(root)
    assert all(m == (0o700 if os.path.isdir(p) else 0o600) for p, m in modes.items()), modes

    listed = run_cli("snapshots", str(root))
    assert listed.code == 0, listed.err
    line = next(x for x in listed.out.splitlines() if x.startswith(snap))
    assert "pid%d" % proc.pid in line and "complete" in line and line.endswith("by hand"), listed.out
    (info,) = [json.loads(x) for x in run_cli("snapshots", str(root), "--json").out.splitlines()]
    assert info["id"] == snap and info["ranks"] == [0] and info["complete"] and info["bytes"] > 1000

    from probe.snapshot import record

    rec = record.read_rank(str(root / snap / "rank-00000.json"))
    stacks = record.evidence_from_json(rec["evidence"][1]).stacks()
    assert [f[0] for f in stacks["MainThread"]][-3:] == ["wait_here", "main", "<module>"], stacks
    assert {"python.backtrace", "python.threads", "python.locals", "process.info"} <= set(rec["tables"])
    names = {row[7] for row in rec["tables"]["python.locals"]["rows"]}
    assert {"api_key", "url"} <= names  # the locals are there, their secrets masked
    text = (root / snap / "rank-00000.json").read_text()
    for secret in ("4f9a2b7c1d8e6f3a", "hunter2hunter2", "s3cr3t-on-argv"):
        assert secret not in text, secret
    assert "trainer:********@data.example.com" in text

    # A process whose agent cannot answer (a C call holds the GIL): its stacks read from outside are recorded.
    proc = spawn("gil_sum.py")
    try:
        made = run_cli(str(proc.pid), "snapshot", "--dir", str(root), "--json", timeout=scaled(60))
    finally:
        proc.kill()
    assert made.code == 0, made.err
    answer = json.loads(made.out)
    rec = record.read_rank(os.path.join(answer["path"], "rank-00000.json"))
    assert [e["state"] for e in rec["evidence"]] == ["gil_held", "gil_held"]
    assert any(row[5] == "<module>" and row[6].endswith("gil_sum.py") for row in rec["tables"]["python.backtrace"]["rows"])
    assert "its agent cannot answer" in rec["missing"]["python.locals"]
    assert len(run_cli("snapshots", str(root), "--json").out.splitlines()) == 2


@needs_torchrun
def test_snapshot_of_a_two_rank_job_records_both_ranks_owner_only_without_the_token(tmp_path):
    from probe import _paths
    from probe.snapshot import record

    root = tmp_path / "snaps"
    with torchrun_job("dist_hang.py", 2, timeout=180, HANG_SKIP_RANK="1", TORCH_FR_BUFFER_SIZE="2000") as (port, pids):
        made = run_cli("127.0.0.1:%d" % port, "--deadline", str(scaled(30)), "snapshot", "--dir", str(root), "--json",
                       timeout=scaled(120))
        with open(_paths.job_token_path(port)) as handle:
            token = handle.read().strip()
    assert made.code == 0, made.out + made.err
    answer = json.loads(made.out)
    assert answer["ranks"] == [0, 1] and answer["failed"] == {} and answer["job"] == "port%d" % port
    snap = root / answer["id"]
    assert sorted(os.listdir(snap)) == ["meta-%s.json" % os.uname().nodename, "rank-00000.json", "rank-00001.json"]
    modes = _modes(root)
    assert all(m == (0o700 if os.path.isdir(p) else 0o600) for p, m in modes.items()), modes
    assert len(token) >= 16
    for name in os.listdir(snap):
        assert token not in (snap / name).read_text(), name

    funcs, last_seq = {}, {}
    for rank in (0, 1):
        rec = record.read_rank(str(snap / record.rank_file_name(rank)))
        assert rec["rank"] == rank and rec["pid"] == pids[rank] and rec["reason"] == "by hand"
        rows = rec["tables"]["python.backtrace"]["rows"]
        funcs[rank] = {row[5] for row in rows}
        fr = rec["tables"]["torch.flight_recorder"]
        seq = [n for n, _ in fr["columns"]].index("collective_seq_id")
        last_seq[rank] = max(row[seq] for row in fr["rows"])
        assert [record.evidence_from_json(e).state for e in rec["evidence"]] == ["answering", "answering"]
    assert "train_step" in funcs[0] and "load_next_batch" not in funcs[0]
    assert "load_next_batch" in funcs[1] and "train_step" not in funcs[1]
    assert last_seq[0] == last_seq[1] + 1, last_seq  # rank 1 never issued the all_reduce rank 0 waits in


def test_store_groups_one_jobs_nodes_bounds_a_record_and_cleans_up_by_the_rule(tmp_path, monkeypatch):
    from probe.snapshot import capture, record, store

    root = str(tmp_path / "snaps")
    now = time.time()

    def save(job, started, ranks, reason="stall", **meta):
        records = [capture.failed_record(job, r, "h", 100 + r, reason, "test") for r in ranks]
        for rec in records:  # stacks, so that each rank counts as recorded
            rec["tables"]["python.backtrace"] = {"columns": [["func", "VARCHAR"]], "rows": [["f"]], "truncated": False}
        return store.save_snapshot(root, job, reason, records, started, **meta)[0]

    # Two nodes' watches of one job recording the same stall 30 s apart: one snapshot; another job's stays apart.
    first = save("j1", now - 100, [0, 1], by="watch", node=0, run="torchelastic one")
    second = save("j1", now - 70, [2, 3], by="watch", node=1, run="torchelastic one")
    save("j2", now - 90, [0])
    listed = store.list_snapshots(root)
    assert [(s.job, s.ranks, s.complete) for s in listed] == [("j1", [0, 1, 2, 3], True), ("j2", [0], True)]
    assert [os.path.basename(f) for f in store.resolve(first)] == ["rank-%05d.json" % r for r in range(4)]
    assert sorted(store.resolve(second)) == sorted(store.resolve(first))

    # One recording is one node's directory a run: a later record of the same node, another run of the job on
    # the same port (its own run id), and a snapshot taken by hand are each a snapshot of their own, and
    # reading a directory reads its own ranks' files, though another holds the same ranks.
    again = save("j1", now - 95, [0, 1], by="watch", node=0, run="torchelastic one")
    other_run = save("j1", now - 90, [2, 3], by="watch", node=1, run="torchelastic other")
    by_hand = save("j1", now - 80, [0, 1])
    for path in (again, other_run, by_hand):
        assert [os.path.dirname(f) for f in store.resolve(path)] == [path] * 2, path
    assert [s.path for s in store.list_snapshots(root) if s.job == "j1"] == [first, again, other_run, by_hand]
    for path in (again, other_run, by_hand):
        shutil.rmtree(path)

    # A record over PROBE_SNAPSHOT_MAX_RANK_BYTES is cut, the biggest table first, and says so.
    monkeypatch.setenv("PROBE_SNAPSHOT_MAX_RANK_BYTES", str(100 * 1024))
    big = capture.failed_record("j3", 0, "h", 1, "test", "test")
    big["tables"]["python.locals"] = {"columns": [["v", "VARCHAR"]], "rows": [["x" * 100]] * 5000, "truncated": False}
    path = record.write_rank(str(tmp_path), big)
    assert os.path.getsize(path) <= 100 * 1024
    back = record.read_rank(path)
    assert back["tables"]["python.locals"]["truncated"] and "bounded" in back["missing"]["python.locals"]

    # Cleanup: this host's snapshots of the job beyond the newest KEEP, and any older than MAX_AGE_DAYS;
    # a directory holding anything but probe's files is never removed.
    monkeypatch.setenv("PROBE_SNAPSHOT_KEEP", "2")
    monkeypatch.setenv("PROBE_SNAPSHOT_MAX_AGE_DAYS", "1")
    old, foreign = (store.new_snapshot_dir(root, "j2", now - days * 86400) for days in (3, 4))
    for path in (old, foreign):
        record.write_rank(path, capture.failed_record("j2", 0, "h", 1, "test", "test"))
        record.write_meta(path, {"job": "j2", "started": now - 3 * 86400, "ranks": [], "failed": {"0": "test"}})
    with open(os.path.join(foreign, "notes.txt"), "w") as handle:
        handle.write("someone's own file")
    for k in range(3):
        save("j1", now - 50 + 10 * k, [0])
    left = sorted(os.listdir(root))
    assert not os.path.exists(old) and os.path.exists(foreign)
    assert sorted(d for d in left if d.startswith("j1-")) == sorted(
        store.snapshot_id("j1", now - 50 + 10 * k) for k in (1, 2)), left
