"""``probe PID inject`` into programs whose main thread waits in an event loop's system call (issue 32,
item 20): asyncio (an idle actor, a server, a pipeline), and selector loops written by hand over epoll,
poll and select. The wait is entered by a C function Python code called, with the GIL released; the
injector must take it for the safe point it is, start the agent at once, and leave the loop working.

The rule is tested on gdb's backtraces first, shapes the real targets do not give (a wait inside an
extension, one through another library, the interpreter's own waits), then on the real targets.
"""

import os
import socket
import time
from typing import List, Optional

import pytest

from probe.injector.methods import GIL_ENSURE, PENDING, plan
from probe.injector.threads import Frame, ThreadState, is_parked_safely, parse_backtraces, with_libraries
from procs import pyenv_python, run_cli, scaled, target_env
from test_inject import needs_ptrace

SELECT_SO = "/usr/lib/python3.11/lib-dynload/select.cpython-311-x86_64-linux-gnu.so"
UVLOOP_SO = "/venv/lib/python3.11/site-packages/uvloop/loop.cpython-311-x86_64-linux-gnu.so"


def _thread(funcs: List[str], libraries: Optional[List[Optional[str]]] = None, gil: Optional[bool] = False,
            lwp: int = 100) -> ThreadState:
    libraries = libraries or [None] * len(funcs)
    return ThreadState(1, lwp, "python", tuple(Frame(f, None, lib) for f, lib in zip(funcs, libraries)), gil)


# ---------------------------------------------------------------- the rule, on gdb's backtraces

def test_a_wait_gdb_cannot_name_is_placed_by_the_library_its_address_lies_in():
    text = ('Thread 1 (Thread 0x7f0a323d4b80 (LWP 100) "python"):\n'
            '#0  0x00007f0a31d26ef3 in epoll_wait ()\n#1  0x00007f0a3155564a in ?? ()\n'
            '#2  0x00366f2b00000000 in ?? ()\n#3  0x0000000000000000 in ?? ()\n')
    threads = parse_backtraces(text)
    assert threads[0].frames[1].address == 0x7f0a3155564a
    inside = with_libraries(threads, [(0x7f0a31550000, 0x7f0a31560000, SELECT_SO)])
    outside = with_libraries(threads, [(0x7f0a31560000, 0x7f0a31570000, SELECT_SO)])
    assert inside[0].frames[1].library == SELECT_SO and outside[0].frames[1].library is None
    parked = ThreadState(1, 100, "python", inside[0].frames, False)
    assert is_parked_safely(parked)
    assert plan([parked], 100).method == GIL_ENSURE
    assert not is_parked_safely(ThreadState(1, 100, "python", outside[0].frames, False))


@pytest.mark.parametrize("funcs, libraries", [
    (["epoll_wait", "??"], [None, SELECT_SO]),  # asyncio's default loop, select built as a module
    (["__GI___poll", "??"], [None, SELECT_SO]),  # PollSelector
    (["__GI___select", "??", "??"], [None, SELECT_SO, None]),  # SelectSelector
    (["epoll_pwait", "??", "??", "??"], [None, UVLOOP_SO, UVLOOP_SO, None]),  # uvloop: libuv inside the extension
    (["__futex_abstimed_wait_common64", "__pthread_cond_wait_common", "pthread_cond_timedwait", "??"],
     [None, None, None, "/x/_queue_ext.abi3.so"]),  # a condition wait in an extension's ``with nogil``
    (["epoll_wait", "select_epoll_poll", "method_vectorcall_FASTCALL_KEYWORDS", "_PyEval_EvalFrameDefault"],
     None),  # select built into the interpreter, its _impl inlined
    (["__GI___poll", "select_poll_poll", "method_vectorcall_FASTCALL", "_PyEval_EvalFrameDefault"], None),
    (["__libc_recv", "my_builtin_recv", "cfunction_vectorcall_O"], None),
])
def test_any_blocking_call_entered_by_a_c_function_python_called_is_safe(funcs, libraries):
    assert is_parked_safely(_thread(funcs, libraries))
    assert not is_parked_safely(_thread(funcs, libraries, gil=True))  # gdb's GIL check still decides
    assert not is_parked_safely(_thread(funcs, libraries, gil=None))


@pytest.mark.parametrize("funcs, libraries", [
    # a wait inside another library, which may hold locks of its own across it
    (["__futex_abstimed_wait_common", "pthread_cond_wait", "??", "??"],
     [None, None, "/usr/lib/x86_64-linux-gnu/libstdc++.so.6", None]),
    (["epoll_wait", "??"], [None, "/opt/lib/libtorch_cpu.so"]),
    (["poll", "??", "??"], [None, "/usr/lib/x86_64-linux-gnu/libffi.so.8", None]),  # ctypes: through libffi
    (["epoll_wait", "??"], [None, None]),  # an address in no mapped file
    # not a blocking call: a lock inside malloc, whatever called it
    (["__lll_lock_wait_private", "__libc_malloc", "??"], [None, None, SELECT_SO]),
    (["__lll_lock_wait", "pthread_mutex_lock", "??"], [None, None, SELECT_SO]),
    # the interpreter's own waits: for the GIL, for the import lock
    (["__futex_abstimed_wait_common", "pthread_cond_timedwait", "take_gil", "_PyEval_EvalFrameDefault"], None),
    (["__futex_abstimed_wait_common", "sem_clockwait", "PyThread_acquire_lock_timed", "_PyImport_AcquireLock",
      "_imp_acquire_lock", "cfunction_vectorcall_NOARGS"], None),
    # a named function not called by the call glue (who knows what it holds)
    (["epoll_wait", "helper_in_some_lib", "another_helper"], None),
])
def test_other_waits_are_not_taken_for_safe(funcs, libraries):
    assert not is_parked_safely(_thread(funcs, libraries))


def test_a_plan_with_the_main_thread_in_an_event_loop_runs_on_it():
    main = _thread(["epoll_wait", "??"], [None, SELECT_SO], lwp=100)
    chosen = plan([main], 100)
    assert (chosen.method, chosen.thread.lwp) == (GIL_ENSURE, 100)
    other = _thread(["epoll_wait", "??"], [None, "/opt/lib/libtorch_cpu.so"], lwp=100)
    assert plan([other], 100).method == PENDING  # not safe: the pending call, with its reason


# ---------------------------------------------------------------- real event loops

def _echo(port: int, text: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=scaled(10)) as conn:
        conn.sendall(text)
        conn.settimeout(scaled(10))
        return conn.makefile("rb").readline()


def _in_syscall(pid: int) -> bool:
    """The main thread is blocked in a system call (the kernel's word, not a sleep's)."""
    try:
        with open("/proc/%d/syscall" % pid) as handle:
            fields = handle.read().split()
    except OSError:
        return False
    return bool(fields) and fields[0] not in ("running", "-1")


def _wait_in_syscall(pid: int) -> None:
    deadline = time.monotonic() + scaled(10)
    while not _in_syscall(pid):
        assert time.monotonic() < deadline, "the loop never waited"
        time.sleep(0.02)


@needs_ptrace
@pytest.mark.parametrize("mode", ["asyncio-sleep", "asyncio-server", "asyncio-pipeline", "selector-default",
                                  "selector-poll", "selector-select"])
def test_inject_into_a_program_waiting_in_its_event_loop(target_factory, mode):
    env = target_env(probe=False)
    env.pop("PYTHONPATH", None)  # the injector must expose probe itself
    proc = target_factory("inject_event_loop.py", mode, probe=False, env=env)
    port = int(next(line.split()[1] for line in proc.lines if line.startswith("PORT")))
    _wait_in_syscall(proc.pid)
    started = time.monotonic()
    result = run_cli(str(proc.pid), "inject", "--timeout", str(int(scaled(15))))
    took = time.monotonic() - started
    assert result.code == 0, result.err
    assert "gil_ensure" in result.out, result.out  # run on the waiting thread, not queued behind the wait
    answer = run_cli(str(proc.pid), "eval", "import threading; threading.main_thread().name")
    assert answer.code == 0 and "MainThread" in answer.out, answer.err
    assert took < scaled(10), "inject took %.1f s" % took
    assert proc.alive()
    if port:  # the loop still serves: the wait the agent started from went on as before
        assert _echo(port, b"after the injection\n") == b"after the injection\n"
    assert proc.alive()


@needs_ptrace
@pytest.mark.parametrize("version", ["3.9", "3.10", "3.12", "3.13"])
def test_inject_into_an_asyncio_server_of_each_cpython(target_factory, version):
    """Each version's select module and call glue differ (3.12 and 3.13 enter C functions otherwise)."""
    python = pyenv_python(version)
    if not python:
        pytest.skip("CPython %s is not installed" % version)
    env = target_env(probe=False)
    env.pop("PYTHONPATH", None)
    proc = target_factory("inject_event_loop.py", "asyncio-server", probe=False, env=env, python=python)
    port = int(next(line.split()[1] for line in proc.lines if line.startswith("PORT")))
    _wait_in_syscall(proc.pid)
    result = run_cli(str(proc.pid), "inject", "--timeout", str(int(scaled(20))))
    assert result.code == 0 and "gil_ensure" in result.out, result.err
    answer = run_cli(str(proc.pid), "eval", "import sys; sys.version_info[:2]")
    assert answer.code == 0 and answer.out.strip() == str(tuple(int(p) for p in version.split("."))), answer.err
    assert _echo(port, b"still serving\n") == b"still serving\n"
