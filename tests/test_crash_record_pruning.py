"""Crash records are pruned stopped-on-purpose first: records of processes stopped on purpose (SIGTERM,
Ctrl-C: demo runs, tests, cancelled jobs) have a bound of their own, so that twenty demo runs cannot push
out the record of a real crash; real crashes keep theirs up to their own bound.

The records are real: a target that crashed, one stopped with SIGTERM and one with Ctrl-C leave them;
many more are copies of those under the names of processes that no longer run (a pid above any in use),
each a second apart, newer than the crash. ``probe list`` does the pruning."""

import os
import shutil
import signal
import time

from probe.reader import crash
from procs import crash_record_of, die_with_record, run_cli, target_env

_GONE_PID = 4190000  # above any pid a test machine hands out (PID_MAX_LIMIT is 4194304)


def _die(directory, script: str, args, how=None) -> str:
    """The path of the crash record ``script`` left, ended as ``how`` says (see procs.die_with_record)."""
    proc = die_with_record(str(directory), script, args, how)
    return str(directory / crash_record_of(str(directory), proc.pid))


def _copies(directory, source: str, count: int, first: int, newest: float) -> list:
    """``count`` copies of the record at ``source``, as left by processes that no longer run, written one
    second apart up to ``newest``: (path, when written), newest first."""
    out = []
    for i in range(count):
        path = str(directory / ("%d-1.crash" % (_GONE_PID + first + i)))
        shutil.copyfile(source, path)
        os.chmod(path, 0o600)
        when = newest - i
        os.utime(path, (when, when))
        out.append((path, when))
    return out


def _prune(directory) -> None:
    listed = run_cli("list", "--agents-only", "--all", "--json",
                     env=target_env(probe=False, PROBE_RUNTIME_DIR=str(directory)))
    assert listed.code == 0, listed.err


def test_twenty_demo_runs_do_not_push_out_a_real_crash(tmp_path) -> None:
    tmp_path.chmod(0o700)
    crashed = _die(tmp_path, "hung.py", ["segv"])
    terminated = _die(tmp_path, "idle.py", [], signal.SIGTERM)
    interrupted = _die(tmp_path, "idle.py", [], signal.SIGINT)  # Ctrl-C: an uncaught KeyboardInterrupt
    by_path = {r.path: r for r in crash.records(str(tmp_path))}
    assert "SIGSEGV" in by_path[crashed].cause and by_path[crashed].has_stacks, by_path[crashed].cause
    assert by_path[terminated].cause.startswith("SIGTERM"), by_path[terminated].cause
    assert "KeyboardInterrupt" in by_path[interrupted].cause, by_path[interrupted].cause

    now = time.time()
    old = now - 3 * 3600  # the crash happened three hours ago; the demo runs since
    os.utime(crashed, (old, old))
    stopped = _copies(tmp_path, terminated, 15, 0, now - 10) + _copies(tmp_path, interrupted, 15, 100, now - 40)
    os.unlink(terminated)
    os.unlink(interrupted)
    _prune(tmp_path)

    left = set(os.listdir(tmp_path))
    assert os.path.basename(crashed) in left, sorted(left)  # the real crash is kept
    kept = {p for p, _ in stopped if os.path.basename(p) in left}
    assert len(kept) == crash.KEEP_STOPPED_RECORDS, len(kept)
    newest = [p for p, _ in sorted(stopped, key=lambda item: -item[1])][:crash.KEEP_STOPPED_RECORDS]
    assert kept == set(newest), "not the newest stopped ones were kept"


def test_real_crashes_keep_their_own_bound(tmp_path) -> None:
    tmp_path.chmod(0o700)
    crashed = _die(tmp_path, "hung.py", ["segv"])
    terminated = _die(tmp_path, "idle.py", [], signal.SIGTERM)
    now = time.time()
    crashes = [crashed] + [p for p, _ in _copies(tmp_path, crashed, crash.KEEP_RECORDS + 4, 0, now - 100)]
    os.utime(crashed, (now - 50, now - 50))  # the newest crash
    os.utime(terminated, (now, now))  # a demo run, newer than every crash
    _prune(tmp_path)

    left = set(os.listdir(tmp_path))
    kept = [p for p in crashes if os.path.basename(p) in left]
    assert len(kept) == crash.KEEP_RECORDS, len(kept)
    assert kept == crashes[:crash.KEEP_RECORDS], "not the newest crashes were kept"
    assert os.path.basename(terminated) in left  # a stopped one does not take a crash's place, nor lose its own
