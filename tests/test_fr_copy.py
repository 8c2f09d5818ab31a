"""The Flight Recorder of a rank that cannot run (issue 37, item 2): the copy its agent keeps in
``fr-<pid>.json`` (``probe.tables.torch.fr_copy``), read by ``diagnose`` (directly and through the node
helper) for a rank that a C call keeps the GIL of or that is stopped, shown as a copy with its age; a job
without the recorder says why; a file at that name that is not a copy is refused in a line."""

import json
import os
import pickle
import re
import signal

from probe import _paths
from probe.tables.torch.fr_copy import BODY_AT, HEADER, MARKS, MARKS_AT, MARKS_MAGIC, MAX_BODY, MAX_MARKS
from procs import run_cli, target_env
from test_cluster import needs_torchrun, torchrun_job
from test_diagnose import DEGRADED, HEALTHY, STUCK, _diagnose, _expect, _until

_AT = re.compile(r"by its Flight Recorder's copy \(as of [0-9:.]+, [0-9.]+ s before this look\) it is at "
                 r"(gloo:all_reduce|collective) #(\d+) of group 0(?: \(past its copied entries, which end at "
                 r"#\d+\))?; rank 0 waits in gloo:all_reduce #(\d+)")


def _copied(pid):
    """The header of process ``pid``'s copy once it holds a dump of group 0's collectives, else None."""
    from probe.diagnose.fr_copy import read

    header, _, _ = read(pid)
    return header if header is not None and header.get("copied_at") and header["marks"].get("0") else None


@needs_torchrun
def test_a_stopped_rank_and_one_whose_gil_is_held_are_placed_by_the_copy_of_their_flight_recorder(tmp_path):
    control = tmp_path / "control"
    control.write_text("")
    with torchrun_job("dist_diagnose.py", 2, timeout=180, extra=("--monitor-interval=60",), DIAG_CONTROL=str(control),
                      TORCH_FR_BUFFER_SIZE="2000", PROBE_FR_COPY_EVERY="0.5") as (port, pids):
        master = "127.0.0.1:%d" % port
        header = _until(lambda: _copied(pids[1]), 30, "rank 1's copy with its entries")
        assert header["pid"] == pids[1] and header["every"] == 0.5 and header["why"] is None, header
        assert os.stat(os.path.join(_paths.runtime_dir(), "fr-%d.json" % pids[1])).st_mode & 0o777 == 0o600

        # Stopped: the copy says where it was, against the collective rank 0 waits in.
        os.kill(pids[1], signal.SIGSTOP)
        try:
            result = _expect(master, STUCK, "rank 1 is stopped", "by its Flight Recorder's copy")
            found = _AT.search(result.out)
            assert found, result.out
            # it did not issue the one rank 0 waits in; it may have issued the one before since its last look
            assert int(found.group(3)) - 2 <= int(found.group(2)) < int(found.group(3)), found.group(0)
            assert "numbers as of its agent's last look at" in result.out, result.out
        finally:
            os.kill(pids[1], signal.SIGCONT)
        _expect(master, HEALTHY, "HEALTHY")

        # A C call keeps the GIL, taken between two steps: the numbers at the step's end are exact.
        control.write_text("gil 1\n")
        result = _expect(master, STUCK, "rank 1 cannot answer", "by its Flight Recorder's copy")
        found = _AT.search(result.out)
        assert found and int(found.group(2)) + 1 == int(found.group(3)), result.out
        # the same through the node helper (torchrun's launcher here), which reads the copy on its host
        via = run_cli(master, "--via", "helpers", "diagnose", timeout=90)
        assert via.code == STUCK and _AT.search(via.out), (via.out, via.err)
        report = json.loads(run_cli(master, "--via", "helpers", "diagnose", "--json", timeout=90).out)
        verdict = next(v for v in report["verdicts"] if v["kind"] == "gil_held")
        line = next(e for e in verdict["evidence"] if e["text"].startswith("its Flight Recorder's copy"))
        assert line["rows"] and line["rows"][0]["pg"] == "0" and line["rows"][0]["last_op"] == "gloo:all_reduce", line


@needs_torchrun
def test_a_job_without_the_flight_recorder_says_so_for_the_rank_that_cannot_run(tmp_path):
    control = tmp_path / "control"
    control.write_text("")
    with torchrun_job("dist_diagnose.py", 2, timeout=180, extra=("--monitor-interval=60",), DIAG_CONTROL=str(control),
                      TORCH_FR_BUFFER_SIZE="0", PROBE_FR_COPY_EVERY="0.5") as (port, pids):
        master = "127.0.0.1:%d" % port
        _until(lambda: _copied(pids[1]), 30, "rank 1's copy")
        control.write_text("gil 1\n")
        result = _expect(master, STUCK, "rank 1 cannot answer", "its Flight Recorder is off (TORCH_FR_BUFFER_SIZE=0")
        assert "only its collective numbers were kept" in result.out, result.out
        # the numbers alone still place it: rank 0's, from its agent's file, is the next one
        found = re.search(r"it is at collective #(\d+) of group 0; rank 0 is at #(\d+) \(its recorder is off: the "
                          r"numbers alone\)", result.out)
        assert found and int(found.group(1)) + 1 == int(found.group(2)), result.out


@needs_torchrun
def test_torch_s_own_dump_stands_for_a_rank_that_cannot_run_where_the_job_names_one(tmp_path):
    """PROBE_FR_COPY_EVERY=0 (no copy) and TORCH_FR_DUMP_TEMP_FILE: before any dump, both are said; once
    rank 1 wrote its dump where torch's watchdog would (then a C call keeps its GIL), the dump places it."""
    control = tmp_path / "control"
    control.write_text("")
    prefix = str(tmp_path / "fr_")
    with torchrun_job("dist_diagnose.py", 2, timeout=180, extra=("--monitor-interval=60",), DIAG_CONTROL=str(control),
                      TORCH_FR_BUFFER_SIZE="2000", PROBE_FR_COPY_EVERY="0", TORCH_FR_DUMP_TEMP_FILE=prefix) as (port, pids):
        master = "127.0.0.1:%d" % port
        os.kill(pids[1], signal.SIGSTOP)
        try:
            result = _expect(master, STUCK, "rank 1 is stopped", "its agent keeps no copy of its Flight Recorder "
                             "(PROBE_FR_COPY_EVERY=0", "torch wrote no dump of it (%s1" % prefix)
        finally:
            os.kill(pids[1], signal.SIGCONT)
        _expect(master, HEALTHY, "HEALTHY")
        control.write_text("dumpgil 1\n")
        result = _expect(master, STUCK, "rank 1 cannot answer", "by torch's own Flight Recorder dump")
        found = re.search(r"by torch's own Flight Recorder dump \(as of [0-9:.]+, [0-9.]+ s before this look\) it is at "
                          r"gloo:all_reduce #(\d+) of group 0; rank 0 waits in gloo:all_reduce #(\d+)", result.out)
        assert found and int(found.group(1)) + 1 == int(found.group(2)), result.out
        assert "torch's own Flight Recorder dump (%s1, written at" % prefix in result.out, result.out


def test_a_file_at_the_copy_s_name_that_is_not_a_copy_is_refused_in_a_line(target_factory, tmp_path):
    """A process whose GIL a C call keeps (no torch): where its copy would be, a link, garbage, a file too big,
    a header whose entries are cut short or are not JSON, one left by another process; each is refused with
    a line saying why, and diagnose still gives its verdict. Then torch's own dump, a pickle that names a
    function: refused before a byte is unpickled."""
    prefix = str(tmp_path / "fr_")
    proc = target_factory("gil_sleep.py", env=target_env(RANK="0", TORCH_FR_DUMP_TEMP_FILE=prefix))
    path = os.path.join(_paths.runtime_dir(), "fr-%d.json" % proc.pid)
    head = {"format": "probe-fr-copy", "version": 1, "pid": proc.pid, "ticks": 0, "every": 2.0, "interval": 2.0,
            "groups": ["0"], "groups_cut": 0, "copied_at": 1.0, "copy_s": 0.01, "copy_seq": {"0": 3}, "body": 1000,
            "why": None}
    page = MARKS.pack(MARKS_MAGIC, 2, 1.0, 1, *([3] + [0] * (MAX_MARKS - 1)))

    def header(numbers=page, **changes):
        raw = json.dumps(dict(head, **changes)).encode()
        raw += b" " * (HEADER - 1 - len(raw)) + b"\n"
        return raw + b"\0" * (MARKS_AT - HEADER) + numbers + b"\0" * (BODY_AT - MARKS_AT - len(numbers))

    cases = [
        ("link", "it is a symbolic link"),
        (b"\x80\x04garbage" * 1000, "its header is not JSON"),
        ("huge", "more than a copy holds"),
        (header(), "is cut short: 0 of its 1000 bytes"),
        (header(body=10) + b"{not json!", "its entries are not JSON"),
        (header(pid=1), "it names process 1"),
        (header(ticks=1), "left by an earlier process %d" % proc.pid),
        (header(groups=[1]), "its header's groups are not names"),
        (header(numbers=b"\0" * MARKS.size), "its numbers' page is not one"),
    ]
    try:
        for content, words in cases:
            if os.path.lexists(path):
                os.unlink(path)
            if content == "link":
                os.symlink("/etc/passwd", path)
            elif content == "huge":
                with open(path, "wb") as handle:
                    handle.truncate(BODY_AT + MAX_BODY + 1)
            else:
                with open(path, "wb") as handle:
                    handle.write(content)
                os.chmod(path, 0o600)
            result = _diagnose(str(proc.pid))
            assert result.code in (STUCK, DEGRADED) and "Traceback" not in result.err, (words, result)
            assert words in result.out, (words, result.out)
    finally:
        if os.path.lexists(path):
            os.unlink(path)
    result = _diagnose(str(proc.pid))
    assert "its agent kept no copy of its Flight Recorder" in result.out, result.out
    assert "torch wrote no dump of it (%s0" % prefix in result.out, result.out
    # torch's own dump at the name the job gave: a pickle that names a function is refused unread
    with open(prefix + "0", "wb") as handle:
        handle.write(pickle.dumps({"entries": [os.system]}))
    result = _diagnose(str(proc.pid))
    assert result.code == STUCK and "its pickle uses STACK_GLOBAL, which can import or call code" in result.out, \
        result.out


def test_the_stall_record_of_a_stopped_rank_holds_its_flight_recorder_from_the_copy(tmp_path, monkeypatch):
    """The node helper's stall watch records a job whose rank 1 is stopped: rank 1's record holds
    ``torch.flight_recorder`` from its copy, said to be one, and diagnose of the record places it."""
    from probe.snapshot import record, store
    from test_snapshot_watch import _dirs, _torchrun_stepping
    from torch_job import stop_launcher

    run, snaps, _ = _dirs(tmp_path, "stop")
    monkeypatch.setenv("PROBE_RUNTIME_DIR", run)  # where this job's files are, for this test's own reads
    # PROBE_HANG_MIN: however slow the start on a loaded machine, no record before the first step
    launcher, _, ranks = _torchrun_stepping(tmp_path, "stop", run, PROBE_SNAPSHOT_DIR=snaps, PROBE_HANG_AFTER="3",
                                            PROBE_HANG_MIN="600", TORCH_FR_BUFFER_SIZE="2000", PROBE_FR_COPY_EVERY="0.5")
    try:
        _until(lambda: _copied(ranks[1]), 30, "rank 1's copy with its entries")
        os.kill(ranks[1], signal.SIGSTOP)
        try:
            found = _until(lambda: [s for s in store.list_snapshots(snaps) if s.complete] or None, 60,
                           "the stall recorded")
        finally:
            os.kill(ranks[1], signal.SIGCONT)
    finally:
        stop_launcher(launcher)
    rec = record.read_rank(os.path.join(found[0].path, "rank-00001.json"))
    last = rec["evidence"][-1]
    assert last["state"] == "stopped" and last["fr_copy"]["pid"] == ranks[1], last
    table = rec["tables"]["torch.flight_recorder"]
    assert table["rows"] and "its Flight Recorder's copy (entries as of" in rec["missing"]["torch.flight_recorder"], rec
    shown = run_cli("snapshot:%s" % found[0].path, "diagnose", env=target_env(probe=False, PROBE_RUNTIME_DIR=run))
    assert "rank 1 was stopped" in shown.out and "by its Flight Recorder's copy (as of" in shown.out, shown.out
    queried = run_cli("snapshot:%s" % found[0].path, "--ranks", "1", "query",
                      "SELECT count(*) AS n, max(collective_seq_id) AS top FROM torch.flight_recorder",
                      env=target_env(probe=False, PROBE_RUNTIME_DIR=run))
    assert queried.code == 0 and re.search(r"\b[1-9]\d*\b", queried.out), queried


def test_rules_place_a_silent_rank_by_its_copy_and_a_recorded_copy_that_is_junk_costs_only_its_line():
    """The rules alone, on evidence made by hand: rank 1 (GIL held) at #6 by its copy, rank 0 waiting in #7;
    then the same copy's fields made junk, as a hostile record may hold them: the verdict stands."""
    from probe.diagnose.evidence import RankEvidence, Sample
    from probe.diagnose.rules import judge
    from test_diagnose import _cmd, _in_all_reduce, _rank

    def fr(seq, done):
        return [{"pg": "0", "pg_desc": "default_pg", "last_seq": seq, "last_op": "gloo:all_reduce", "last_done": done,
                 "last_age": 5.0, "period": 0.05, "recent": "%d\tgloo:all_reduce\t[[1]]\t[\"Float\"]" % seq}]

    def look(copy, at):
        silent = RankEvidence(1, "h", 101, state="gil_held", why="GIL held", source="outside", fr=fr(5, True),
                              fr_copy=copy, at=at)
        return Sample({0: _rank(0, _in_all_reduce(), 1.0, fr(7, False), at=at), 1: silent}, 2, at=at)

    copy = {"pid": 101, "looked_at": 1000.0, "copied_at": 999.0, "marks": {"0": 6}, "read_at": 1004.0}
    verdict = judge(look(copy, 0.0), look(copy, 1.0), _cmd).verdicts[0]
    assert verdict.kind == "gil_held" and verdict.culprits == [1], verdict
    assert "by its Flight Recorder's copy (as of " in verdict.summary and ", 4.0 s before this look) it is at " \
           "collective #6 of group 0 (past its copied entries, which end at #5); rank 0 waits in gloo:all_reduce #7" \
           in verdict.summary, verdict.summary
    junk = {"pid": "x", "looked_at": "soon", "copied_at": [1], "marks": {"0": "six", "1": 2 ** 70}, "why": {"a": 1}}
    verdict = judge(look(junk, 0.0), look(junk, 1.0), _cmd).verdicts[0]
    assert verdict.kind == "gil_held" and verdict.culprits == [1], verdict
