"""Records you can act on (issue 32): a rank SIGKILLed under torchrun is dead at the job's address once the
job is gone (its record, said to be one, the signal named as torchrun saw it); two runs of a job on one
PROBE_PORT leave two records, each read as its own; a snapshot taken by hand hides no stall's own record;
a program run alone under PROBE_PORT is watched too; a pid with no process is not recorded. Real torchrun
gloo jobs on the CPU (tests/targets/snap_train.py), real signals, each in directories of its own."""

import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Dict, Tuple

from probe.snapshot import store
from probe.tables.torch.steps import read_progress
from procs import TARGETS, Proc, run_cli, scaled, spawn, target_env
from test_snapshot_watch import WATCH_LOOKS_S, _stepping_and_watched, _until
from test_torchrun import _free_port_pair
from torch_job import TORCHRUN, _free_port, stop_launcher


def _job(tmp_path, name: str, port: int, **env: str) -> Tuple[subprocess.Popen, Proc, str]:
    """A 2-rank torchrun job of snap_train.py on PROBE_PORT ``port``; its runtime directory (its own)."""
    run = str(tmp_path / name / "run")
    os.makedirs(run, 0o700)
    err = open(str(tmp_path / name / "stderr"), "wb")
    try:
        launcher = subprocess.Popen([TORCHRUN, "--nproc_per_node=2", "--master_port=%d" % _free_port(),
                                     os.path.join(TARGETS, "snap_train.py")], stdout=subprocess.PIPE, stderr=err,
                                    env=target_env(PROBE_PORT=str(port), PROBE_RUNTIME_DIR=run, **env),
                                    start_new_session=True)
    finally:
        err.close()
    return launcher, Proc(launcher, "torchrun (%s)" % name), run


def _stderr(tmp_path, name: str) -> str:
    with open(str(tmp_path / name / "stderr"), "rb") as handle:
        return handle.read().decode("utf-8", "replace")[-3000:]


Empty = SimpleNamespace(steps=0)


def _cli_env(run: str, **extra: str) -> Dict[str, str]:
    return target_env(probe=False, PROBE_RUNTIME_DIR=run, **extra)


def test_a_sigkilled_rank_is_dead_at_the_jobs_address_from_its_record_with_its_signal(tmp_path):
    snaps, control = str(tmp_path / "snaps"), str(tmp_path / "control")
    port = _free_port_pair()
    launcher, output, run = _job(tmp_path, "kill", port, PROBE_SNAPSHOT_DIR=snaps, PROBE_HANG_AFTER="600",
                                 SNAP_CONTROL=control)
    try:
        ranks = _stepping_and_watched(run, output)
        os.kill(ranks[1], signal.SIGKILL)
        assert launcher.wait(scaled(60)) != 0
    finally:
        stop_launcher(launcher)
    found = _until(lambda: [s for s in store.list_snapshots(snaps) if s.complete], 10, "the death recorded")
    assert len(found) == 1, found
    # torchrun logged "failed (exitcode: -9)" for rank 1: the record names the signal, not a guess
    assert found[0].reason.startswith("rank 1 died: killed by SIGKILL (torchrun saw exitcode -9)"), (
        found[0].reason, _stderr(tmp_path, "kill"))

    # Nothing answers at the job's address: its record is read there, said to be one, from --snapshot-dir ...
    shown = run_cli("127.0.0.1:%d" % port, "diagnose", "--snapshot-dir", snaps, env=_cli_env(run))
    assert shown.code == 12, shown
    lines = shown.out.splitlines()
    assert lines[0].startswith("DEAD JOB: the job that served at 127.0.0.1:%d has died" % port), shown.out
    assert "probe's record of it, not a live look: snapshot:%s, written " % found[0].path in lines[0], shown.out
    assert lines[1].startswith("RECORD: "), shown.out
    verdicts = [line for line in lines if line.startswith("DEAD: ")]
    assert verdicts[0].startswith("DEAD: rank 1 is dead") and "SIGKILL" in verdicts[0], shown.out
    assert "SIGKILL, the OOM killer, SIGTERM) or os._exit" not in shown.out, shown.out
    # ... and from $PROBE_SNAPSHOT_DIR, as JSON: what the others were doing (rank 0's last stacks) comes after
    as_json = run_cli("127.0.0.1:%d" % port, "diagnose", "--json", env=_cli_env(run, PROBE_SNAPSHOT_DIR=snaps))
    assert as_json.code == 12, as_json
    report = json.loads(as_json.out)
    assert report["dead_job"]["snapshot"] == found[0].path and report["record"]["ranks"] == [0, 1], report
    assert report["verdicts"][0]["kind"] == "dead" and report["verdicts"][0]["culprits"] == [1], report["verdicts"]
    # (where rank 0 was depends on the moment of the kill: in sync_loss's all_reduce, mostly, or asleep in main)
    assert any(v["culprits"] == [0] and "snap_train.py" in json.dumps(v) for v in report["verdicts"]), report["verdicts"]
    # ranks and a rank's own port at that address: the hint names the record (not "start the job with
    # PROBE_PORT", which it was), and following it reads the death
    for target, command in (("127.0.0.1:%d" % port, "ranks"), ("127.0.0.1:%d" % port, "backtrace")):
        told = run_cli(target, command, env=_cli_env(run, PROBE_SNAPSHOT_DIR=snaps))
        assert told.code == 3 and "a job served here and died" in told.err, (command, told.err)
        assert "start the job with" not in told.err, told.err
        hint = told.err.split("`")[1]
        assert hint == "probe snapshot:%s diagnose" % found[0].path, told.err
        followed = run_cli(*hint.split()[1:], env=_cli_env(run))
        assert followed.code == 12 and "rank 1 is dead" in followed.out, followed
    # another port, where no job died: still no agent there (exit 3), no record said
    elsewhere = _free_port_pair() + 1  # free with the port below it a moment ago (another test's job may be near)
    other = run_cli("127.0.0.1:%d" % elsewhere, "diagnose", env=_cli_env(run, PROBE_SNAPSHOT_DIR=snaps))
    assert other.code == 3 and "DEAD JOB" not in other.out, other
    # the listing says what the record holds: both ranks, rank 1 without stacks
    listed = run_cli("snapshots", snaps, env=_cli_env(run))
    assert listed.code == 0 and " 0-1 (no stacks: 1) " in listed.out, listed.out


def test_two_runs_on_one_port_are_two_records_each_read_as_its_own_and_a_hand_snapshot_hides_no_stall(tmp_path):
    """Run A (rank 1 stops) is recorded and stopped; run B on the same PROBE_PORT is snapshotted by hand,
    then rank 0 stops: three snapshots, each read as itself; the default read is B's stall."""
    snaps = str(tmp_path / "snaps")
    port = _free_port_pair()
    culprits = {}
    for name, skipper in (("a", 1), ("b", 0)):
        control = str(tmp_path / ("control-" + name))
        launcher, output, run = _job(tmp_path, name, port, PROBE_SNAPSHOT_DIR=snaps, PROBE_HANG_AFTER="3",
                                     PROBE_HANG_MIN="600", SNAP_CONTROL=control)
        try:
            _stepping_and_watched(run, output)
            before = {s.id for s in store.list_snapshots(snaps)}
            if name == "b":
                by_hand = run_cli("127.0.0.1:%d" % port, "snapshot", "--dir", snaps, "--json",
                                  env=_cli_env(run))
                assert by_hand.code == 0, by_hand
                before.add(json.loads(by_hand.out)["id"])
            with open(control, "w") as handle:
                handle.write("skip %d\n" % skipper)
            new = _until(lambda: [s for s in store.list_snapshots(snaps) if s.id not in before and s.complete], 90,
                         "run %s's stall recorded" % name)
            assert len(new) == 1 and new[0].reason.startswith("stall: "), (new, _stderr(tmp_path, name))
            culprits[new[0].id] = skipper
        finally:
            stop_launcher(launcher)

    listed = store.list_snapshots(snaps)
    assert [s.reason.split(":")[0] for s in listed] == ["stall", "by hand", "stall"], listed
    shown = run_cli("snapshots", snaps, env=_cli_env(run))
    assert shown.code == 0 and all(s.id in shown.out for s in listed), shown.out
    for snap_id, culprit in culprits.items():
        verdict = run_cli("snapshot:%s" % os.path.join(snaps, snap_id), "diagnose", "--json", env=_cli_env(run))
        report = json.loads(verdict.out)
        assert verdict.code == 11 and report["verdicts"][0]["culprits"] == [culprit], (snap_id, report["verdicts"])
        assert report["record"]["reasons"][0].startswith("stall: "), report["record"]
    newest = run_cli("snapshot:%s" % snaps, "diagnose", "--json", env=_cli_env(run))
    report = json.loads(newest.out)
    assert report["verdicts"][0]["culprits"] == [0] and report["record"]["reasons"][0].startswith("stall: "), report


def test_a_program_run_alone_under_probe_port_is_watched_and_recorded_at_its_stall(tmp_path):
    run, snaps, control = str(tmp_path / "run"), str(tmp_path / "snaps"), str(tmp_path / "control")
    os.mkdir(run, 0o700)
    port = _free_port_pair()
    proc = spawn("snap_train.py", env=target_env(PROBE_PORT="127.0.0.1:%d" % port, PROBE_RUNTIME_DIR=run,
                                                 PROBE_SNAPSHOT_DIR=snaps, PROBE_HANG_AFTER="3", PROBE_HANG_MIN="600",
                                                 PROBE_HELPER_LINGER_S="2", SNAP_CONTROL=control), timeout=60,
                 wait_socket=False)
    try:
        progress = os.path.join(run, "progress-%d.bin" % proc.pid)
        _until(lambda: (read_progress(progress) or Empty).steps > 3, 30, "steps counted")
        time.sleep(WATCH_LOOKS_S)  # two looks of the watch, once a second: it has seen it step (nothing to wait on)
        with open(control, "w") as handle:
            handle.write("skip 0\n")
        found = _until(lambda: [s for s in store.list_snapshots(snaps) if s.complete], 60, "the stall recorded")
        assert found[0].job == "pid%d" % proc.pid and found[0].reason.startswith("stall: "), found
        shown = run_cli("snapshot:%s" % snaps, "diagnose", env=_cli_env(run))
        assert shown.out.startswith("RECORD: a record of process %d, written " % proc.pid), shown
        assert "stall: no step for " in shown.out.splitlines()[0], shown.out
        stacks = run_cli("snapshot:%s" % snaps, "backtrace", env=_cli_env(run))
        assert stacks.code == 0 and "load_next_batch" in stacks.out, stacks
    finally:
        proc.kill()


def test_a_pid_with_no_process_is_not_recorded(tmp_path):
    snaps = str(tmp_path / "snaps")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(scaled(30))
    shown = run_cli(str(gone.pid), "snapshot", "--dir", snaps, env=target_env(probe=False))
    assert shown.code == 3 and "no process with pid %d" % gone.pid in shown.err, shown
    assert not os.path.exists(snaps) or not os.listdir(snaps), os.listdir(snaps)


def test_a_zombies_exit_status_names_its_signal_and_an_unseen_death_says_the_signal_is_not_known():
    """Where no launcher logged the exit (a node helper beside mpirun, srun, accelerate), the watch reads a
    dead rank's exit status while it is a zombie: a real child, SIGKILLed and not reaped yet."""
    from probe import _paths
    from probe.host import exits

    silent = "ended without a word: a signal that runs no handler (SIGKILL, the OOM killer, SIGTERM) or os._exit"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        ticks = _paths.process_start_ticks(str(child.pid))
        assert "most likely SIGKILL" in exits.death_words(child.pid, silent)  # nothing seen yet: not known
        os.kill(child.pid, signal.SIGKILL)
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # dead, still a zombie: not reaped
        exits.note_zombie(child.pid, ticks + 1)  # another process's start time: not this one's status
        assert exits.seen(child.pid) is None
        exits.note_zombie(child.pid, ticks)
        assert exits.seen(child.pid) == (-9, "its exit status"), exits.seen(child.pid)
        words = exits.death_words(child.pid, silent)
        assert words.startswith("killed by SIGKILL (its exit status: signal 9)"), words
        assert exits.death_words(child.pid, "SIGTERM (terminated)") == "SIGTERM (terminated); killed by SIGKILL " \
            "(its exit status: signal 9)"
    finally:
        child.kill()
        child.wait(scaled(10))
