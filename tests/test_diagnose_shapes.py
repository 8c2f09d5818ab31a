"""``probe diagnose`` on code shaped unlike the targets that taught its rules, run from a folder named
``probe`` (a clone of this repository is one): locks named ``a`` and ``b`` with comments on their lines, a
helper's parameter for a module's lock, ``self.state.guard`` of two objects, an RLock taken with
``acquire()``; a stopped process's ``where`` down to the program's own frame; a GIL-held rank whose peer
waits outside any torch.distributed frame, and its native frames read at the job's TCP address; what a
record, a forked worker and a process without the trace are told."""

import json
import os
import shutil
import signal
import time

from probe.diagnose.verdict import EXIT_CODES
from procs import TARGETS, run_cli, scaled, target_env
from test_cluster import needs_torchrun, torchrun_job

STUCK = EXIT_CODES["stuck"]


def _in_probe_folder(tmp_path, script="lock_shapes.py"):
    """``script`` copied to ``tmp_path/probe/job/``: the path has a folder named probe, as a clone's has."""
    folder = tmp_path / "probe" / "job"
    folder.mkdir(parents=True)
    shutil.copy(os.path.join(TARGETS, script), folder / script)
    return str(folder / script)


def _line(path, text):
    with open(path) as handle:
        return next(i for i, line in enumerate(handle, 1) if line.strip() == text)


def _line_in(path, function, text):
    """The line of ``text`` within ``function`` (its first after the ``def`` line)."""
    with open(path) as handle:
        lines = handle.read().splitlines()
    start = lines.index(function)
    return start + 1 + next(i for i, line in enumerate(lines[start:]) if line.strip() == text)


def _diagnose(target, *args):
    return run_cli(target, "diagnose", *args, timeout=scaled(60))


def _stuck(target, *args):
    """Diagnose until it says stuck (a first look at a fresh agent may outlast the deadline on a loaded box:
    it loads DuckDB there), within a bound; the last result."""
    deadline = time.monotonic() + scaled(60)
    result = _diagnose(target, *args)
    while result.code != STUCK and time.monotonic() < deadline:
        result = _diagnose(target, *args)
    return result


def test_a_deadlock_of_locks_a_and_b_with_comments_in_a_probe_folder_names_both_holders(tmp_path, target_factory):
    path = _in_probe_folder(tmp_path)
    proc = target_factory(path, "cycle")
    result = _stuck(str(proc.pid))
    first = result.out.splitlines()[0]
    assert result.code == STUCK, (result.code, result.out, result.err)
    assert first.startswith("STUCK: process %d: left, right wait for a lock" % proc.pid), first
    # the helper's parameter `gate` is the module's `a`: the same lock, by identity
    assert "a deadlock: thread left waits for b, held by thread right; thread right waits for gate (a), held by " \
           "thread left" in first, first
    assert "thread right holds b since right (%s:%d)" % (path, _line(path, "with b:  # first b")) in first, first
    assert "thread left holds a since left (%s:%d)" % (path, _line(path, "with a:  # first a")) in first, first
    assert "where: left (%s:%d), thread left" % (path, _line(path, "with b:  # then b")) in result.out, result.out
    assert "take the locks in one order in every thread (b -> a" in result.out
    assert "sorted(locals())" not in result.out and "eval --frame left:0 'repr(b)'" in result.out, result.out
    report = json.loads(_diagnose(str(proc.pid), "--json").out)
    rows = [row for piece in report["verdicts"][0]["evidence"] for row in piece["rows"]]
    assert sorted((r["thread"], r["lock"], r["holder"], r["holder_func"], r["holder_with_line"]) for r in rows) == [
        ("left", "b", "right", "right", _line(path, "with b:  # first b")),
        ("right", "gate", "left", "left", _line(path, "with a:  # first a"))], rows


def test_the_holder_of_self_state_guard_is_the_thread_holding_that_object_not_another_objects(tmp_path,
                                                                                             target_factory):
    path = _in_probe_folder(tmp_path)
    proc = target_factory(path, "guard")
    result = _stuck(str(proc.pid))
    first = result.out.splitlines()[0]
    assert result.code == STUCK, (result.code, result.out, result.err)
    assert "MainThread waits for self.state.guard, held by thread keeper in Service.keep (%s:%d) (by the lock's " \
           "identity)" % (path, _line(path, "never.wait()")) in first, first
    assert "decoy" not in result.out, result.out  # the other Service's guard, of the same name


def test_an_rlock_taken_with_acquire_is_held_by_its_owner_named_at_its_own_frame(tmp_path, target_factory):
    path = _in_probe_folder(tmp_path)
    proc = target_factory(path, "owner")
    result = _stuck(str(proc.pid))
    assert result.code == STUCK, (result.code, result.out, result.err)
    assert "MainThread waits for b, held by thread owner in own_rlock (%s:%d) (the RLock's owner)" % (
        path, _line_in(path, "def own_rlock(taken: threading.Event) -> None:", "never.wait()")) in result.out, result.out
    assert "holder unknown" not in result.out


def test_a_stopped_process_in_a_probe_folder_is_placed_in_its_own_function(tmp_path, target_factory):
    path = _in_probe_folder(tmp_path)
    proc = target_factory(path, "stop")
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        result = _stuck(str(proc.pid))
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert result.code == STUCK, (result.code, result.out, result.err)
    where = next(line for line in result.out.splitlines() if line.startswith("  where: "))
    assert "Condition.wait (" in where and " called from wait_for_peer (%s:%d)" % (
        path, _line_in(path, "def wait_for_peer() -> None:", "never.wait()")) in where, where
    assert "kill -CONT %d" % proc.pid in result.out


def test_a_record_of_a_stopped_process_gives_no_advice_for_the_process(tmp_path, target_factory):
    path = _in_probe_folder(tmp_path)
    proc = target_factory(path, "stop")
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        made = run_cli(str(proc.pid), "snapshot", "--dir", str(tmp_path), "--json", timeout=scaled(60))
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
    assert made.code == 0, made.err
    result = run_cli("snapshot:" + json.loads(made.out)["path"], "diagnose", timeout=scaled(60))
    assert result.code == STUCK and "was stopped (SIGSTOP, or a debugger)" in result.out, (result.out, result.err)
    assert "kill -CONT" not in result.out and "called from wait_for_peer (" in result.out, result.out


def test_a_child_forked_from_a_probed_process_is_told_so_not_to_pip_install(target_factory):
    proc = target_factory("forks_child.py")
    child = int(proc.read_line(scaled(30)).split()[1])
    try:
        result = run_cli(str(child), "health")
    finally:
        os.kill(child, signal.SIGKILL)  # not our child to reap: its parent's, which the fixture ends
    assert result.code == 3, (result.out, result.err)
    assert "it was forked from process %d, which runs an agent" % proc.pid in result.err, result.err
    assert "pip install" not in result.err and "`probe %d inject`" % child in result.err, result.err


def test_not_known_says_what_and_how_in_words_not_an_engines_error(target_factory):
    # SQL on the client's side, as users get it by default: the trace's table is one the agent has no rows for
    proc = target_factory("no_optimizer.py", env=target_env(PROBE_SQL_IN_AGENT=""), timeout=scaled(90))
    result = _diagnose(str(proc.pid))
    unknown = result.out.split("not known (evidence that could not be had):")[1]
    assert "Catalog Error" not in result.out and "\\n" not in unknown, result.out
    assert "trace: no torch trace has run in this process on process %d (`probe %d trace start` records each step" \
           % (proc.pid, proc.pid) in unknown, unknown


def test_rules_library_code_is_the_targets_layout_not_a_folder_named_probe():
    from probe.diagnose.library import Library

    library = Library(["/opt/py/lib/python3.11", "/opt/py/lib/python3.11/site-packages", "/srv/tools/probe"],
                      known=True)
    assert not library.holds("/tmp/x/probe/job/train.py") and not library.holds("/home/u/probe/probe/train.py")
    assert library.holds("/opt/py/lib/python3.11/threading.py") and library.holds("/srv/tools/probe/agent/x.py")
    assert library.holds("/venv/lib/python3.11/site-packages/torch/nn/modules/module.py")
    assert not library.holds("/srv/tools/probe-extras/x.py")  # a root is a directory, not a prefix of a name
    unknown = Library()
    assert unknown.holds("/usr/lib/python3.11/threading.py") and not unknown.holds("/tmp/x/probe/job/train.py")


@needs_torchrun
def test_a_gil_held_rank_names_the_rank_waiting_outside_torch_frames_and_its_c_frames_are_read_at_tcp(tmp_path):
    path = _in_probe_folder(tmp_path, "dist_gil_async.py")
    with torchrun_job(path, 2, timeout=240, extra=("--monitor-interval=60",)) as (port, pids):
        master = "127.0.0.1:%d" % port
        deadline = time.monotonic() + scaled(60)
        result = _diagnose(master)
        while "rank 0 makes no progress" not in result.out and time.monotonic() < deadline:
            result = _diagnose(master)  # rank 0 reaches its wait a moment after its READY: a look may come first
        first = result.out.splitlines()[0]
        assert result.code == STUCK and first.startswith("STUCK: rank 1 cannot answer: "), (result.out, result.err)
        assert "in stall_in_c (dist_gil_async.py:" in first, first
        assert "; rank 0 makes no progress (no step, no CPU, the same stack), most likely waiting for it" in first
        assert "waiting (not to blame): rank 0" in result.out
        assert "rank 0: wait_for_grads (%s:%d)" % (path, _line(path, "work.wait()")) in result.out, result.out
        native = run_cli(master, "--ranks", "1", "backtrace", "--native", timeout=scaled(60))
        assert native.code == 0 and "needs it on this host" not in native.err, (native.out, native.err)
        assert "stall_in_c" in native.out and "sleep" in native.out, native.out


def test_rules_a_lock_named_a_with_comments_is_a_lock_wait_with_its_holder_from_an_old_record(tmp_path):
    """Evidence as an older agent or a hostile record leaves it: no python.locks rows (or rows of the wrong
    types), no layout: the holder is found by the expression's text, comments left out."""
    from probe.client.results import Frame
    from probe.diagnose.evidence import RankEvidence, Sample
    from probe.diagnose.rules import judge

    folder = tmp_path / "probe" / "job"
    folder.mkdir(parents=True)
    source = folder / "work.py"
    source.write_text("import threading\na = threading.Lock()\n\n\ndef hold(ev):\n    with a:  # kept\n"
                      "        ev.wait()\n\n\ndef work():\n    with a:  # wanted\n        pass\n")
    path = str(source)
    frames = [Frame(1, "MainThread", 1, True, 0, "work", path, 11, "with a:  # wanted"),
              Frame(2, "keeper", 2, False, 0, "hold", path, 7, "ev.wait()")]
    looks = [RankEvidence(0, "h", 100, frames=frames, at=t, locks=[{"thread_id": [1]}, "x"], paths={"a": 1},
                          holder_id=[2], threads=[{"thread_id": 1, "thread_name": "MainThread", "is_main": True,
                                                   "cpu": 1.0}]) for t in (0.0, 3.0)]
    report = judge(Sample({0: looks[0]}, 1, True, at=0.0), Sample({0: looks[1]}, 1, True, at=3.0),
                   lambda ranks, rest: "probe T %s" % rest)
    verdict = report.verdicts[0]
    assert report.status == "stuck" and verdict.kind == "lock_wait", [v.summary for v in report.verdicts]
    assert "MainThread waits for a, held by thread keeper in hold (%s:7) (by its stack)" % path in verdict.summary


def test_a_lock_behind_a_property_is_read_without_calling_it(tmp_path, target_factory):
    path = _in_probe_folder(tmp_path)
    proc = target_factory(path, "property")
    result = _stuck(str(proc.pid))
    assert result.code == STUCK, (result.code, result.out, result.err)
    keep = _line_in(path, "class Watched:", "never.wait()")
    assert "MainThread waits for self.guard, held by thread keeper in Watched.keep (%s:%d)" % (path, keep) \
        in result.out, result.out
    calls = run_cli(str(proc.pid), "eval", "Watched.calls", timeout=scaled(30))
    assert calls.code == 0 and calls.out.strip() == "2", calls  # the program's two reads, none of probe's
