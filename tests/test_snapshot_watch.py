"""The stall watch (issue 21): a rank's step counter kept in its progress file, and the node helper that
reads those files, noticing that the ranks stopped stepping and recording them before the process group's
timeout ends the job; a healthy and a slow job are recorded never. Real torchrun gloo jobs on the CPU
(tests/targets/snap_train.py), each in a runtime and snapshot directory of its own."""

import os
import stat
import subprocess
import time
from typing import Dict, List, Tuple

from probe import _paths
from probe.snapshot import record, store
from probe.tables.torch.steps import read_progress
from procs import BASE_SCALE, TARGETS, Proc, run_cli, scaled, spawn, target_env
from test_torchrun import _free_port_pair
from torch_job import TORCHRUN, _free_port, ready_lines, stop_launcher

PG_TIMEOUT_S = 20  # the record ends 5-7 s after the stall (hang_after 3 s, then 4-5 s of capture)


# Two looks of a node helper's watch (once a second, on its own thread: a few reads of /proc and the progress
# files), which leave nothing outside to wait on. Scaled to the machine, not to its load: a thread asleep
# for a second is woken about on time on a loaded box, where scaled() made this 12 s.
WATCH_LOOKS_S = 2.0 * BASE_SCALE


def _until(check, timeout: float, what: str):
    deadline = time.monotonic() + scaled(timeout)
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, "timed out waiting for %s" % what
        time.sleep(0.1)


def _dirs(tmp_path, name: str) -> Tuple[str, str, str]:
    run = str(tmp_path / name / "run")
    os.makedirs(run, 0o700)
    return run, str(tmp_path / name / "snaps"), str(tmp_path / name / "control")


def _torchrun(tmp_path, name: str, run: str, **env: str) -> Tuple[subprocess.Popen, Proc]:
    """A 2-rank torchrun job of snap_train.py with an agent a rank and PROBE_PORT (torchrun's launcher is
    the node's helper); its stderr goes to a file beside the job's directories."""
    err = open(str(tmp_path / name / "stderr"), "wb")
    try:
        launcher = subprocess.Popen([TORCHRUN, "--nproc_per_node=2", "--master_port=%d" % _free_port(),
                                     os.path.join(TARGETS, "snap_train.py")], stdout=subprocess.PIPE, stderr=err,
                                    env=target_env(PROBE_PORT=str(_free_port_pair()), PROBE_RUNTIME_DIR=run, **env),
                                    start_new_session=True)
    finally:
        err.close()
    return launcher, Proc(launcher, "torchrun (%s)" % name)


def _torchrun_stepping(tmp_path, name: str, run: str, **env: str) -> Tuple[subprocess.Popen, Proc, Dict[int, int]]:
    """:func:`_torchrun`, then :func:`_stepping_and_watched`; once more, on fresh ports, where the launcher
    died at its rendezvous because another process took the free port it was given in between (EADDRINUSE:
    the suite runs on two workers)."""
    for attempt in (1, 2):
        launcher, output = _torchrun(tmp_path, name, run, **env)
        try:
            return launcher, output, _stepping_and_watched(run, output)
        except AssertionError:
            stop_launcher(launcher)
            with open(str(tmp_path / name / "stderr"), "rb") as handle:
                clash = b"EADDRINUSE" in handle.read()
            if attempt == 2 or launcher.poll() is None or not clash:
                raise
    raise AssertionError("unreachable")


def _ranks(output: Proc) -> Dict[int, int]:
    return {int(words[2]): int(words[1]) for words in ready_lines(output, 2, time.monotonic() + scaled(90))}


def _stepping_and_watched(run: str, output: Proc) -> Dict[int, int]:
    """The ranks (rank -> pid) once each has counted steps in its progress file and the node helper's watch,
    which looks once a second, has had two looks at them alive (its looks leave nothing outside to wait on)."""
    ranks = _ranks(output)
    files = [os.path.join(run, "progress-%d.bin" % pid) for pid in ranks.values()]
    _until(lambda: all(read_progress(f) for f in files), 30, "the ranks' progress files")
    time.sleep(WATCH_LOOKS_S)
    return ranks


def _stderr(tmp_path, name: str) -> str:
    try:
        with open(str(tmp_path / name / "stderr"), "rb") as handle:
            return handle.read().decode("utf-8", "replace")[-4000:]
    except OSError:
        return ""


def test_a_rank_keeps_its_step_count_in_a_progress_file_that_goes_at_exit(tmp_path):
    run, _, control = _dirs(tmp_path, "one")
    proc = spawn("snap_train.py", env=target_env(PROBE_RUNTIME_DIR=run, SNAP_CONTROL=control), wait_socket=False)
    try:
        path = os.path.join(run, "progress-%d.bin" % proc.pid)
        first = _until(lambda: read_progress(path), 20, "the progress file")
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
        second = _until(lambda: (lambda p: p if p and p.steps > first.steps else None)(read_progress(path)), 10,
                        "the step count to move")
        assert second.pid == proc.pid and second.start_ticks == _paths.process_start_ticks(str(proc.pid)), second
        assert second.first <= first.last < second.last <= time.monotonic(), (first, second)  # the host's clock
        assert 0 < second.step_time < 5, second
        with open(control, "w") as handle:
            handle.write("exit\n")
        assert proc.popen.wait(scaled(20)) == 0
        assert not os.path.exists(path), "the agent left its progress file behind at exit"
    finally:
        proc.kill()

    # Killed without its exit hooks: the file stays, and goes with the stale socket at the next `probe list`.
    os.unlink(control)
    proc = spawn("snap_train.py", env=target_env(PROBE_RUNTIME_DIR=run, SNAP_CONTROL=control), wait_socket=False)
    try:
        path = os.path.join(run, "progress-%d.bin" % proc.pid)
        _until(lambda: read_progress(path), 20, "the progress file")
        proc.popen.kill()
        proc.popen.wait(scaled(10))
    finally:
        proc.kill()
    assert os.path.exists(path)
    time.sleep(_paths.STALE_AFTER_S + 0.5)
    listed = run_cli("list", env=target_env(probe=False, PROBE_RUNTIME_DIR=run))
    assert listed.code == 0, listed
    assert not os.path.exists(path) and not os.path.exists(os.path.join(run, "%d.sock" % proc.pid)), os.listdir(run)


def test_a_rank_that_skips_an_all_reduce_is_recorded_before_the_timeout_ends_the_job_an_evaluation_never(tmp_path):
    run, snaps, control = _dirs(tmp_path, "hang")
    # PROBE_HANG_MIN: however slow the start on a loaded machine, no record before the first step
    launcher, output = _torchrun(tmp_path, "hang", run, PROBE_SNAPSHOT_DIR=snaps, PROBE_HANG_AFTER="3",
                                 PROBE_HANG_MIN="600", PG_TIMEOUT_S=str(PG_TIMEOUT_S), SNAP_CONTROL=control)
    try:
        ranks = _ranks(output)
        files = [os.path.join(run, "progress-%d.bin" % pid) for pid in ranks.values()]
        # steps counted (the step counter comes in once the program has imported torch.optim)
        _until(lambda: all(read_progress(f) for f in files), 30, "the ranks' progress files")
        # An evaluation: no optimizer step for 8 s, but collectives go on (the Flight Recorder moves): no stall.
        # (The Flight Recorder is asked at hang_after / 2 and at hang_after: two rounds of it.)
        with open(control, "w") as handle:
            handle.write("eval\n")
        evaluating = time.monotonic()
        while time.monotonic() - evaluating < 8:
            assert not store.list_snapshots(snaps), "recorded while collectives went on: %s" % _stderr(tmp_path, "hang")
            time.sleep(0.5)
        with open(control, "w") as handle:
            handle.write("skip 1\n")
        skipped = time.time()
        # rank 0 waits in all_reduce until gloo's timeout raises there; torchrun then stops rank 1 (SIGTERM)
        code = launcher.wait(scaled(PG_TIMEOUT_S + 60))
        ended = time.time()
    finally:
        stop_launcher(launcher)
    assert code != 0, "the job was meant to die of its process group's timeout"
    deaths = {}
    for rank, pid in ranks.items():
        name = next((n for n in os.listdir(run) if n.startswith("%d-" % pid) and n.endswith(".crash")), None)
        assert name, "rank %d left no crash record: %s" % (rank, _stderr(tmp_path, "hang"))
        deaths[rank] = os.stat(os.path.join(run, name)).st_mtime

    found = store.list_snapshots(snaps)
    assert len(found) == 1, (found, _stderr(tmp_path, "hang"))
    snap = found[0]
    assert snap.complete and snap.ranks == [0, 1] and not snap.failed, snap
    assert snap.reason.startswith("stall: no step for"), snap
    meta = _meta(snap)
    # recorded (meta written last) after the stall began and before any rank died of it
    assert skipped < meta["started"] < meta["ended"] < min(min(deaths.values()), ended), (skipped, meta, deaths)
    assert meta["hang_after_s"] == 3.0 and meta["ranks"] == [0, 1], meta

    records = {r: record.read_rank(os.path.join(snap.path, "rank-%05d.json" % r)) for r in (0, 1)}
    for rank, rec in records.items():
        assert rec["pid"] == ranks[rank] and rec["recorded_at"] < deaths[rank], rec
    main = {r: [row[5] for row in rec["tables"]["python.backtrace"]["rows"] if row[3]] for r, rec in records.items()}
    assert "load_next_batch" in main[1] and "sync_loss" not in main[1], main
    assert "sync_loss" in main[0], main
    # each rank's death, after the record, is copied into it: rank 0's timeout, rank 1's SIGTERM (its stacks)
    assert "Uncaught exception" in (records[0]["crash"] or "") and "Timed out" in records[0]["crash"], records[0]["crash"]
    assert "sigterm stacks" in (records[1]["crash"] or "") and "load_next_batch" in records[1]["crash"], records[1]["crash"]
    assert not [n for n in os.listdir(run) if n.startswith("progress-")], os.listdir(run)

    listed = run_cli("snapshots", snaps, env=target_env(probe=False, PROBE_RUNTIME_DIR=run))
    assert listed.code == 0 and snap.id in listed.out and "complete" in listed.out, listed
    # every rank is dead: the record names the culprit as the live job would have, and shows it apart
    env = target_env(probe=False, PROBE_RUNTIME_DIR=run)
    verdict = run_cli("snapshot:%s" % snap.path, "diagnose", env=env)
    assert verdict.code == 11 and "collective hang" in verdict.out, verdict
    headline = verdict.out.split("\n")[1]
    assert "rank 1 did not" in headline and "rank 0 waits" in headline, verdict.out
    assert "load_next_batch" in verdict.out or "orders (" in verdict.out, verdict.out  # orders: load_next_batch's callee
    grouped = run_cli("snapshot:%s" % snap.path, "--all-ranks", "backtrace", env=env)
    assert grouped.code == 0 and "> load_next_batch" in grouped.out, grouped
    with open(os.path.join(run, [n for n in os.listdir(run) if n.startswith("node-") and n.endswith(".log")][0])) as log:
        assert "stall recorded in %s" % snap.path in log.read()


def test_a_rank_that_aborts_before_any_stall_leaves_a_record_of_the_node(tmp_path):
    """The watchdog's abort can come before hang_after (a process group timeout shorter than it): the rank's
    death itself is recorded, with its crash record (faulthandler's stacks at SIGABRT) and what the other
    rank showed, though torchrun ends the job at once."""
    run, snaps, control = _dirs(tmp_path, "abort")
    launcher, output = _torchrun(tmp_path, "abort", run, PROBE_SNAPSHOT_DIR=snaps, PROBE_HANG_AFTER="600",
                                 SNAP_CONTROL=control)
    try:
        _stepping_and_watched(run, output)
        with open(control, "w") as handle:
            handle.write("abort 1\n")
        code = launcher.wait(scaled(60))
    finally:
        stop_launcher(launcher)
    assert code != 0
    found = _until(lambda: [s for s in _recorded(snaps) if s.complete], 10, "the death recorded")
    assert len(found) == 1 and found[0].reason.startswith("rank 1 died: SIGABRT"), (found, _stderr(tmp_path, "abort"))
    rec = record.read_rank(os.path.join(found[0].path, "rank-00001.json"))
    assert "Fatal Python error: Aborted" in (rec["crash"] or ""), rec["crash"]
    assert "main" in (rec["crash"] or "") and "snap_train.py" in rec["crash"], rec["crash"]
    assert os.path.exists(os.path.join(found[0].path, "rank-00000.json"))
    shown = run_cli("snapshot:%s" % found[0].path, "--ranks", "1", "backtrace",
                    env=target_env(probe=False, PROBE_RUNTIME_DIR=run))
    assert shown.code == 0 and "snap_train.py" in shown.out, shown


def _recorded(snaps: str) -> List[store.SnapshotInfo]:
    return store.list_snapshots(snaps)


def _meta(snap: store.SnapshotInfo) -> Dict[str, object]:
    return record.read_meta(next(os.path.join(snap.path, n) for n in os.listdir(snap.path) if n.startswith("meta-")))


def test_a_healthy_and_a_slow_job_are_not_recorded_and_the_slow_one_waits_five_steps(tmp_path):
    """The healthy job's hang_after is its PROBE_HANG_MIN (5 s: 5 x its steps is less); the slow one's
    PROBE_HANG_MIN (0.5 s) is less than one of its steps (1 s and more): its record after 5 steps' time, not
    the minimum's, says the rule took its step time. The window is 3 hang_afters of either."""
    jobs = {}
    try:
        for name, step in (("healthy", "0.02"), ("slow", "1.0")):
            run, snaps, control = _dirs(tmp_path, name)
            launcher, output = _torchrun(tmp_path, name, run, PROBE_SNAPSHOT_DIR=snaps, SNAP_CONTROL=control,
                                         PROBE_HANG_MIN="5" if name == "healthy" else "0.5", STEP_SLEEP=step)
            jobs[name] = (launcher, output, snaps, control)
        for job in jobs.values():
            _ranks(job[1])
        watched = time.monotonic()
        while time.monotonic() - watched < 15:
            for name, (launcher, _, snaps, _) in jobs.items():
                assert launcher.poll() is None, "the %s job died: %s" % (name, _stderr(tmp_path, name))
                assert not _recorded(snaps), "the %s job was recorded: %s" % (name, _recorded(snaps))
            time.sleep(0.5)

        # The slow job's hang_after came from its step time (5 x 1 s and more), not from PROBE_HANG_MIN (0.5 s):
        # a real stall of it is recorded, after that long.
        launcher, _, snaps, control = jobs["slow"]
        with open(control, "w") as handle:
            handle.write("skip 1\n")
        found = _until(lambda: [s for s in _recorded(snaps) if s.complete], 60, "the slow job's stall recorded")
        meta = _meta(found[0])
        assert 5 <= meta["hang_after_s"] <= 20, meta
        assert not _recorded(jobs["healthy"][2])
    finally:
        for launcher, _, _, _ in jobs.values():
            stop_launcher(launcher)


def test_a_node_helper_of_its_own_records_its_ranks_and_copies_their_deaths(tmp_path):
    """Ranks of no launcher probe knows (srun's variables) start `python -m probe.host`: its watch records."""
    from test_node_helper import _alive, _helper_pid, ranks_of

    snaps, control = str(tmp_path / "snaps"), str(tmp_path / "control")
    with ranks_of(tmp_path, 2, "snap_train.py", PROBE_HANG_AFTER="3", PROBE_HANG_MIN="600",
                  PROBE_SNAPSHOT_DIR=snaps, SNAP_CONTROL=control) as job:
        procs: Dict[int, Proc] = job["ranks"]  # type: ignore[assignment]
        run = str(job["runtime"])
        _until(lambda: all(read_progress(os.path.join(run, "progress-%d.bin" % p.pid)) for p in procs.values()), 30,
               "the ranks' progress files")
        with open(control, "w") as handle:
            handle.write("skip 0\n")  # every process is its own "rank 0" of torch (no process group): all stop
        found = _until(lambda: [s for s in store.list_snapshots(snaps) if s.complete], 60, "the stall recorded")
        assert len(found) == 1 and found[0].ranks == [0, 1], found
        helper = _helper_pid(run, int(job["port"]))  # type: ignore[arg-type]
        assert helper is not None
        for proc in procs.values():
            proc.kill()  # SIGTERM: each dies with its stacks in its crash record
        files = [os.path.join(found[0].path, "rank-%05d.json" % r) for r in (0, 1)]
        _until(lambda: all(record.read_rank(f)["crash"] for f in files), 15, "the deaths copied into the records")
        for f in files:
            crash = record.read_rank(f)["crash"]
            assert "sigterm stacks" in crash and "load_next_batch" in crash, crash
        # The deaths belong to the stall's record: once the helper has left (PROBE_HELPER_LINGER_S after its
        # last rank died; its watch has looked at the dead ranks by then), no second record was made of them,
        # and the stall's record is the one read by default.
        _until(lambda: not _alive(helper), 30, "the node helper to leave")
        assert os.listdir(snaps) == [os.path.basename(found[0].path)], os.listdir(snaps)
        shown = run_cli("snapshot:%s" % snaps, "diagnose", env=target_env(probe=False, PROBE_RUNTIME_DIR=run))
        assert "stall: no step" in shown.out.splitlines()[0], shown.out
        with open(os.path.join(run, "node-%d.log" % job["port"])) as log:
            assert "stall recorded in %s" % found[0].path in log.read()
