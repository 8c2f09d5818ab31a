"""Every state a process can be in, x backtrace / query / eval / health, through the real CLI.

The agent answers where it can; where it cannot (a C call holds the GIL, the process is stopped, dead,
or a core file) the stacks are read from outside, or the command is refused quickly with the reason.
No command may wait for the 30 s timeout: each is bounded here by ``BOUND_S`` (the documented figure is
about 1.5 s for a GIL-held target; this machine is shared, so the test allows more).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Callable

import pytest

from procs import REPO, TARGETS, Proc, run_cli, spawn

pystack = pytest.importorskip("pystack", reason="reading from outside needs pystack (a dependency of probe on Linux)")

HUNG = os.path.join(TARGETS, "hung.py")
STATES = os.path.join(TARGETS, "states.py")
BOUND_S = 6.0


def _line(path: str, marker: str) -> int:
    with open(path) as handle:
        for number, text in enumerate(handle, 1):
            if marker in text:
                return number
    raise AssertionError("no %s in %s" % (marker, path))


def _timed(*args: str):
    started = time.monotonic()
    result = run_cli(*args, timeout=60)
    elapsed = time.monotonic() - started
    assert elapsed < BOUND_S, "probe %s took %.1f s (bound %.1f s): %s" % (" ".join(args), elapsed, BOUND_S, result.err)
    return result


def _wait_until(check: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for " + what)
        time.sleep(0.02)


def _in_sleep_syscall(pid: int, tid: int) -> bool:
    """The thread is inside nanosleep/clock_nanosleep (the libc sleep() that holds the GIL)."""
    try:
        with open("/proc/%d/task/%d/syscall" % (pid, tid)) as handle:
            number = handle.read().split()[0]
    except (OSError, IndexError):
        return False
    return number in ("35", "230")


def _thread_named(pid: int, name: str) -> int:
    for tid in os.listdir("/proc/%d/task" % pid):
        with open("/proc/%d/task/%s/comm" % (pid, tid)) as handle:
            if handle.read().strip() == name:
                return int(tid)
    raise AssertionError("no thread %s" % name)


def _holding(proc: Proc, mode: str) -> Proc:
    """Wait until the state's sleep has begun (the kernel shows the thread in it): for the GIL modes,
    the call that holds the GIL."""
    tid = proc.pid
    if mode == "gil_thread":
        _wait_until(lambda: any(_in_sleep_syscall(proc.pid, int(t)) and int(t) != proc.pid
                                for t in os.listdir("/proc/%d/task" % proc.pid)), "the holder thread's sleep")
        return proc
    _wait_until(lambda: _in_sleep_syscall(proc.pid, tid), "the main thread's sleep")
    return proc


# -- states where the agent answers -------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sleep", "busy", "lock", "event", "cwait"])
def test_the_agent_answers_every_command_in_live_states(target_factory, mode):
    proc = target_factory("states.py", mode)
    pid = str(proc.pid)
    marker = "%s:%d" % (STATES, _line(STATES, "# STATE:%s" % mode))
    result = _timed(pid, "backtrace")
    assert result.code == 0, result.err
    assert "outside" not in result.err, result.err
    if mode != "busy":
        assert marker in result.out
    result = _timed(pid, "query", "SELECT count(*) AS n FROM python.backtrace WHERE thread_name = 'MainThread'", "-f", "json")
    assert result.code == 0 and json.loads(result.out)[0]["n"] >= 1, result.err
    result = _timed(pid, "eval", "6 * 7")
    assert result.code == 0 and result.out.strip() == "42", result.err
    result = _timed(pid, "health", "--json")
    assert result.code == 0 and json.loads(result.out)["pid"] == proc.pid, result.err


# -- a C call holds the GIL ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode,holder", [("gil", "MainThread"), ("gil_thread", None)])
def test_a_gil_held_target_answers_from_outside_within_the_bound(target_factory, mode, holder):
    proc = _holding(target_factory("hung.py", mode), mode)
    pid = str(proc.pid)
    gil_line = "hold_gil (%s:%d)" % (HUNG, _line(HUNG, "# STATE:gil"))

    result = _timed(pid, "backtrace")
    assert result.code == 0, result.err
    assert "holds the GIL in hold_gil (hung.py:%d)" % _line(HUNG, "# STATE:gil") in result.err
    assert "read from outside" in result.err
    assert gil_line in result.out
    if holder:
        assert 'thread %d "MainThread" holds the GIL' % proc.pid in result.err
    else:
        assert '"holder" holds the GIL' in result.err  # Python thread names, read from outside
    assert 'Thread ' in result.out and '"loader"' in result.out
    assert "probe-accept" not in result.out and "_accept_loop" not in result.out  # the agent's threads are left out

    result = _timed(pid, "query", "SELECT func, lineno, frame_type FROM python.backtrace WHERE depth = 0", "-f", "json")
    assert result.code == 0, result.err
    rows = json.loads(result.out)
    assert {"func": "hold_gil", "lineno": _line(HUNG, "# STATE:gil"), "frame_type": "python"} in rows
    assert "holds the GIL" in result.err

    result = _timed(pid, "query", "SELECT * FROM process.info")
    assert result.code == 5 and "process.info needs the agent" in result.err, result.err

    result = _timed(pid, "eval", "1 + 1")
    assert result.code == 5, result.err
    assert "holds the GIL in hold_gil" in result.err and "eval can run only once that call returns" in result.err

    result = _timed(pid, "health")
    assert result.code == 5, result.err
    assert "agent blocked" in result.out and "GIL held by thread" in result.out and "hold_gil" in result.out

    result = _timed(pid, "backtrace", "--native")
    assert result.code == 0, result.err
    block = result.out.split("\n\n")
    holding = [b for b in block if "hold_gil" in b][0]
    assert "[C] sleep" in holding or "[C] __nanosleep" in holding or "[C] clock_nanosleep" in holding, holding
    assert holding.index("[C]") < holding.index("hold_gil")  # the C call sits above the Python frame that made it


def test_an_eval_refused_while_the_gil_was_held_never_runs_later(target_factory, tmp_path):
    marker = tmp_path / "ran"
    proc = _holding(target_factory("hung.py", "gil_for", "4"), "gil")
    result = _timed(str(proc.pid), "eval", "open(%r, 'w').close()" % str(marker))
    assert result.code == 5, result.err
    _wait_until(lambda: run_cli(str(proc.pid), "--wait", "5", "health").code == 0, "the GIL to come back", 30)
    result = run_cli(str(proc.pid), "eval", "import os; os.path.exists(%r)" % str(marker))
    assert result.code == 0 and result.out.strip() == "False", (result.out, result.err)
    assert not marker.exists()


# -- stopped ---------------------------------------------------------------------------------------------


def test_a_stopped_target_answers_from_outside_and_refuses_eval(target_factory):
    proc = _holding(target_factory("states.py", "sleep"), "sleep")  # in time.sleep: main_sleep's line
    pid = str(proc.pid)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        _wait_until(lambda: open("/proc/%d/stat" % proc.pid).read().rsplit(")", 1)[1].split()[0] == "T", "SIGSTOP")
        result = _timed(pid, "backtrace")
        assert result.code == 0 and "is stopped (SIGSTOP)" in result.err, result.err
        assert "main_sleep (%s:%d)" % (STATES, _line(STATES, "# STATE:sleep")) in result.out
        result = _timed(pid, "query", "SELECT func FROM python.backtrace WHERE depth = 0 AND is_main", "-f", "json")
        assert result.code == 0 and json.loads(result.out) == [{"func": "main_sleep"}], result.err
        result = _timed(pid, "eval", "1")
        assert result.code == 5 and "kill -CONT %s" % pid in result.err, result.err
        result = _timed(pid, "health")
        assert result.code == 5 and "stopped" in result.out, result.out
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    result = _timed(pid, "eval", "2 + 2")
    assert result.code == 0 and result.out.strip() == "4", result.err


# -- dead ------------------------------------------------------------------------------------------------


def _run_to_death(mode: str) -> Proc:
    proc = spawn("hung.py", [mode], wait_socket=False)
    proc.popen.wait(20)
    return proc


@pytest.mark.parametrize("mode,status,cause", [("segv", -signal.SIGSEGV, "SIGSEGV (segmentation fault)"),
                                               ("abort", -signal.SIGABRT, "SIGABRT (aborted)"),
                                               ("exception", 1, "uncaught exception: ValueError: poisoned batch at step 7")])
def test_a_dead_target_leaves_its_last_stacks(mode, status, cause):
    proc = _run_to_death(mode)
    try:
        assert proc.popen.returncode == status  # its own crash behaviour is unchanged
        err = proc.popen.stderr.read().decode() if proc.popen.stderr else ""
        if mode == "segv":
            assert "Fatal Python error: Segmentation fault" not in err  # faulthandler wrote to the record, not stderr
        if mode == "exception":
            assert "ValueError: poisoned batch at step 7" in err  # the earlier excepthook still printed it
        pid = str(proc.pid)
        line = _line(HUNG, "# STATE:%s" % mode)
        result = _timed(pid, "backtrace")
        assert result.code == 0, result.err
        assert "is dead: %s" % cause in result.err and "crash record" in result.err
        assert "die (%s:%d)" % (HUNG, line) in result.out
        assert "loader" in result.out or "wait (" in result.out  # every thread, the loader's wait included
        assert "_accept_loop" not in result.out
        result = _timed(pid, "query", "SELECT func, lineno FROM python.backtrace WHERE thread_name = 'MainThread' "
                                      "AND func = 'die'", "-f", "json")
        assert result.code == 0 and json.loads(result.out) == [{"func": "die", "lineno": line}], result.err
        result = _timed(pid, "eval", "1")
        assert result.code == 3 and cause in result.err, result.err
        result = _timed(pid, "health")
        assert result.code == 3 and cause in result.out, result.out
        listing = json.loads(run_cli("list", "--json").out)
        assert any(r["pid"] == proc.pid and r["agent"] == "dead" and cause in r["state"] for r in listing), listing
    finally:
        proc.kill()


def test_a_clean_exit_leaves_no_crash_record(target_factory, tmp_path):
    from probe import _paths

    trigger = tmp_path / "go"
    proc = target_factory("states.py", "exit", str(trigger))
    ticks = _paths.process_start_ticks(str(proc.pid))
    record = _paths.crash_record_path(proc.pid, ticks)
    assert os.path.exists(record)  # armed while it runs
    trigger.touch()
    proc.popen.wait(20)
    assert proc.popen.returncode == 0
    assert not os.path.exists(record)


def test_old_crash_records_are_cleaned_up_by_the_documented_rule():
    from probe.reader import crash

    proc = _run_to_death("abort")
    proc.kill()
    path = [r.path for r in crash.records() if r.pid == proc.pid][0]
    old = time.time() - (crash.KEEP_DAYS + 1) * 86400
    os.utime(path, (old, old))
    run_cli("list")
    assert not os.path.exists(path)


# -- core files ------------------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("gcore") is None, reason="gcore comes with gdb (apt-get install gdb)")
def test_a_core_file_from_gcore_answers_backtrace_and_sql(target_factory, tmp_path):
    proc = _holding(target_factory("hung.py", "gil"), "gil")
    prefix = str(tmp_path / "core")
    done = subprocess.run(["gcore", "-o", prefix, str(proc.pid)], capture_output=True, text=True, timeout=120)
    core = "%s.%d" % (prefix, proc.pid)
    assert done.returncode == 0 and os.path.exists(core), done.stderr[-2000:]
    assert proc.alive()  # gcore detached and left it running
    target = "core:" + core
    line = _line(HUNG, "# STATE:gil")
    result = _timed(target, "backtrace")
    assert result.code == 0, result.err
    assert "hold_gil (%s:%d)" % (HUNG, line) in result.out and "core file" in result.err
    result = _timed(target, "query", "SELECT func, lineno FROM python.backtrace WHERE thread_name = 'MainThread' "
                                     "AND depth = 0", "-f", "json")
    assert result.code == 0 and json.loads(result.out) == [{"func": "hold_gil", "lineno": line}], result.err
    result = _timed(target, "backtrace", "--native")
    assert result.code == 0 and "[C] " in result.out, result.err
    result = _timed(target, "eval", "1")
    assert result.code == 3 and "core file" in result.err, result.err
    result = _timed(target, "health")
    assert result.code == 3 and "core file" in result.out and "hold_gil" in result.out, result.out
    result = _timed("core:" + str(tmp_path / "missing"), "backtrace")
    assert result.code == 3 and "no core file at" in result.err, result.err


def _kernel_writes_core_files_here() -> bool:
    """The kernel writes a core into the crashing process's directory only with a plain core_pattern
    (not a pipe to systemd-coredump or apport)."""
    try:
        with open("/proc/sys/kernel/core_pattern") as f:
            pattern = f.read().strip()
    except OSError:
        return False
    return bool(pattern) and not pattern.startswith("|") and "/" not in pattern


@pytest.mark.skipif(not _kernel_writes_core_files_here(), reason="core_pattern does not write core files here")
def test_a_core_file_written_by_the_kernel_at_a_crash_answers_backtrace(tmp_path):
    """What a user usually has: the core dumped by the kernel when the process died (SIGABRT here)."""
    import resource

    script = ("import os, threading, time\n"
              "threading.Thread(target=lambda: time.sleep(600), name='sleeper', daemon=True).start()\n"
              "def about_to_abort():\n    os.abort()\n"
              "about_to_abort()\n")

    hard = resource.getrlimit(resource.RLIMIT_CORE)[1]
    if hard == 0:
        pytest.skip("core files are switched off here (hard RLIMIT_CORE 0)")

    def core_files_on() -> None:
        resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))

    done = subprocess.run([sys.executable, "-c", script], cwd=str(tmp_path), preexec_fn=core_files_on,
                          capture_output=True, timeout=60)
    assert done.returncode == -signal.SIGABRT, done.stderr[-2000:]
    cores = [name for name in os.listdir(tmp_path) if name.startswith("core")]
    if not cores:
        pytest.skip("the kernel wrote no core file (core size limit or core_pattern)")
    result = _timed("core:" + str(tmp_path / cores[0]), "backtrace")
    assert result.code == 0, result.err
    assert "about_to_abort (<string>:4)" in result.out and "core file" in result.err, result.out


# -- native frames on a healthy target --------------------------------------------------------------------


def test_native_frames_of_a_healthy_target_from_backtrace_and_sql(target_factory):
    proc = target_factory("states.py", "sleep")
    pid = str(proc.pid)
    result = _timed(pid, "backtrace", "--native")
    assert result.code == 0, result.err
    main = result.out.split("\n\n")[0]
    assert "[C] time_sleep" in main and main.index("[C] time_sleep") < main.index("main_sleep"), main
    result = _timed(pid, "query", "--native", "SELECT frame_type, count(*) AS n FROM python.backtrace "
                                              "WHERE is_main GROUP BY 1 ORDER BY 1", "-f", "json")
    assert result.code == 0, result.err
    kinds = {r["frame_type"]: r["n"] for r in json.loads(result.out)}
    assert kinds.get("native", 0) > 0 and kinds.get("python", 0) >= 3, kinds
    result = _timed(pid, "eval", "1")  # and the target goes on
    assert result.code == 0, result.err


def test_reader_runs_alone_as_a_module(target_factory):
    proc = _holding(target_factory("hung.py", "gil"), "gil")
    done = subprocess.run([sys.executable, "-m", "probe.reader", str(proc.pid)], capture_output=True, text=True,
                          timeout=30, cwd=REPO)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["gil_holder"] == proc.pid
    assert any(r["func"] == "hold_gil" and r["depth"] == 0 for r in data["rows"])


def test_a_python_process_without_an_agent_still_shows_its_stacks(target_factory):
    proc = _holding(target_factory("states.py", "sleep", probe=False, wait_socket=False), "sleep")
    pid = str(proc.pid)
    result = _timed(pid, "backtrace")
    assert result.code == 0 and "no agent in process %s" % pid in result.err and "read from outside" in result.err
    assert "main_sleep (%s:%d)" % (STATES, _line(STATES, "# STATE:sleep")) in result.out
    result = _timed(pid, "query", "SELECT func FROM python.backtrace WHERE is_main AND depth = 0", "-f", "json")
    assert result.code == 0 and json.loads(result.out) == [{"func": "main_sleep"}], result.err
    result = _timed(pid, "eval", "1")
    assert result.code == 3 and "inject" in result.err, result.err  # eval needs an agent: the hint starts one
