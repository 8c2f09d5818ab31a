"""How the bootstrap statement gets run in the target, chosen from what every thread is doing.

Two gdb methods, never a third:

``pending_call``
    ``Py_AddPendingCall(PyRun_SimpleString, code)``. The interpreter runs it itself, on the main
    thread, at the next point where it checks for signals between bytecodes: the safest point there is.
    gdb's call only takes a lock and sets a flag, so it never blocks; gdb detaches at once and the
    injector waits for the socket from outside. It does not run while the main thread is blocked in C
    (``Event.wait()``, a long ``time.sleep``) or while a C call holds the GIL.

``gil_ensure``
    For a main thread blocked in C: ``PyGILState_Ensure``, ``PyRun_SimpleString``,
    ``PyGILState_Release`` on a thread that is parked in a wait CPython entered with the GIL released
    (see ``threads``), and only when no thread holds the GIL inside a C call (gdb asks
    ``PyGILState_Check`` of every thread while all are stopped). Code is never run on a thread stopped
    inside bytecode.

The statement is written into a fresh anonymous page (``mmap``, a bare system call) rather than
gdb-allocated memory, because gdb allocates with the target's ``malloc``, which deadlocks if a stopped
thread holds malloc's lock. On Python 3.14+ with a client of the same version, ``sys.remote_exec``
(PEP 768) replaces gdb.
"""

import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from probe.injector.gdb import GdbSession
from probe.injector.target import TargetInfo
from probe.injector.threads import (ThreadState, describe, is_in_bytecode, is_parked_safely, is_waiting_for_gil,
                                    parse_backtraces, parse_gil_checks, wait_site, with_gil, with_libraries)

__all__ = ["Plan", "plan", "attach_and_look", "run_plan", "inject_with_remote_exec", "can_remote_exec", "PENDING",
           "GIL_ENSURE", "REMOTE_EXEC"]

PENDING = "pending_call"
GIL_ENSURE = "gil_ensure"
REMOTE_EXEC = "remote_exec"
_PENDING_FUNCS = ("Py_AddPendingCall", "_PyEval_AddPendingCall", "_push_pending_call", "_pop_pending_call",
                  "make_pending_calls", "_Py_HandlePending", "Py_MakePendingCalls")
_LIBC = re.compile(r"/libc(-[\d.]+)?\.so")
_ADDRESS = re.compile(r"\$\d+ = \(void \*\) (0x[0-9a-fA-F]+)")
_INT = re.compile(r"\$\d+ = (-?\d+)")


@dataclass(frozen=True)
class Plan:
    """What to call, on which thread, and (for a pending call) what may keep it from running soon."""

    method: str
    thread: Optional[ThreadState]
    """The thread the call runs on (``gil_ensure``: the parked thread; ``pending_call``: any safe one)."""
    delay: Optional[str] = None
    """Why a pending call may not run soon; None when the main thread will reach bytecode shortly."""
    then_direct: bool = False
    """The main thread sleeps in ``time.sleep``: try the pending call, and if the sleep is long, look again
    and run ``gil_ensure`` on it."""
    gil_kept: bool = False
    """The delay is a C call that keeps the GIL: no agent can start, by any method, before it returns."""


def plan(threads: Sequence[ThreadState], main_lwp: int) -> Plan:
    """Choose the method for threads as gdb saw them (frames and ``holds_gil`` filled in)."""
    main = next((t for t in threads if t.lwp == main_lwp), threads[0] if threads else None)
    if main is None:
        raise ValueError("gdb saw no threads")
    caller = _pending_caller(threads, main)
    holder = next((t for t in threads if t.holds_gil), None)
    if main.holds_gil:
        delay = None if is_in_bytecode(main) else "the main thread is in a C call that holds the GIL: " + describe(main)
        return Plan(PENDING, caller, delay, gil_kept=delay is not None)
    if is_waiting_for_gil(main):
        return Plan(PENDING, caller, None)
    blocker = holder if holder is not None and not is_in_bytecode(holder) else None
    if blocker is not None:
        return Plan(PENDING, caller, "the main thread is blocked (%s) and %s holds the GIL inside a C call"
                    % (describe(main), describe(blocker)), gil_kept=True)
    parked = [t for t in threads if is_parked_safely(t)]
    if is_parked_safely(main):
        if wait_site(main) == "pysleep":  # usually a short nap in a loop: the pending call runs after it
            return Plan(PENDING, caller, None, then_direct=True)
        return Plan(GIL_ENSURE, main)
    if parked:
        return Plan(GIL_ENSURE, parked[0])
    return Plan(PENDING, caller, "the main thread is blocked in C (%s) and no thread is parked in a wait that "
                "is safe to run code on" % describe(main))


def _pending_caller(threads: Sequence[ThreadState], main: ThreadState) -> ThreadState:
    """A thread on which calling Py_AddPendingCall cannot deadlock: one not inside the pending-call code."""
    for thread in [main] + [t for t in threads if t is not main]:
        if not any(f in _PENDING_FUNCS for f in thread.funcs(8)):
            return thread
    return main


def attach_and_look(info: TargetInfo, deadline: float) -> "tuple[GdbSession, List[ThreadState]]":
    """Attach gdb (libpython and libc symbols only) and read every thread's frames and GIL flag."""
    session = GdbSession(info.pid, _libraries(info), _left(deadline), executable="/proc/%d/exe" % info.pid,
                         then=["thread apply all bt 16"])
    try:
        threads = parse_backtraces(session.attached_output)
        if any(f.func == "??" for t in threads for f in t.frames[:16]):
            threads = with_libraries(threads, _regions(info.pid))
        main = next((t for t in threads if t.lwp == info.pid), None)
        if main is not None and is_in_bytecode(main):
            # Executing bytecode needs the GIL: the main thread holds it, and a pending call is the plan
            # whatever the other threads do. Asking every thread (an inferior call each, with the whole
            # process stopped) would only lengthen the pause.
            return session, with_gil(threads, {main.num: True})
        # scheduler-locking: only the asked thread runs PyGILState_Check, the others stay where gdb saw them.
        checks = session.run(["set scheduler-locking on", "thread apply all call (int)PyGILState_Check()",
                              "set scheduler-locking off"], _left(deadline), calls=True)
    except BaseException:
        session.detach()
        raise
    return session, with_gil(threads, parse_gil_checks(checks))


def run_plan(session: GdbSession, chosen: Plan, code: str, deadline: float) -> None:
    """Run ``code`` in the target as ``chosen`` says, then detach: when this returns or raises the target
    runs untraced (gdb said it detached, or was killed); gdb may still be exiting (``finish_detached``)."""
    try:
        if chosen.method == PENDING:
            _pending_call(session, chosen.thread, code, deadline)
            return
        address = _write_code(session, chosen.thread, code, deadline)
        assert chosen.thread is not None
        session.run_call_then_detach([
            "thread %d" % chosen.thread.num,
            "set $probe_gil = (int)PyGILState_Ensure()",
            "call (int)PyRun_SimpleString((char*)%s)" % address,
            "call (void)PyGILState_Release($probe_gil)",
        ], max(_left(deadline), 0.5))
    finally:
        session.detach()


def _pending_call(session: GdbSession, thread: Optional[ThreadState], code: str, deadline: float) -> None:
    """``code`` into a new page, ``Py_AddPendingCall(PyRun_SimpleString, page)``, detach: one batch of gdb
    commands, so the target waits for no round trip between them (each was a few ms of its pause). gdb
    stops at the first error inside the ``if``: no call without the whole statement in place."""
    data = code.encode() + b"\0"
    with tempfile.NamedTemporaryFile(prefix="probe-code-", suffix=".bin") as handle:
        handle.write(data)
        handle.flush()
        out = session.run_call_then_detach(_select(thread) + [
            "set $probe_code = (void*)mmap(0, %d, 3, 34, -1, 0)" % _pages(data),
            "print $probe_code",
            "if $probe_code != 0 && $probe_code != (void*)-1",
            "restore %s binary $probe_code" % handle.name,
            "print (int)Py_AddPendingCall((void*)PyRun_SimpleString, $probe_code)",
            "end",
        ], _left(deadline))
    _mapped(out)
    _check_zero(_after_address(out), "Py_AddPendingCall")


def _regions(pid: int) -> List[Tuple[int, int, str]]:
    """The target's file mappings (start, end, path), to tell which library a frame gdb cannot name is in."""
    found: List[Tuple[int, int, str]] = []
    try:
        with open("/proc/%d/maps" % pid) as handle:
            for line in handle:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith("/"):
                    start, _, end = parts[0].partition("-")
                    found.append((int(start, 16), int(end, 16), parts[5].strip()))
    except (OSError, ValueError):
        pass
    return found


def _libraries(info: TargetInfo) -> List[Tuple[str, int]]:
    """libpython (unless linked into the executable) and libc, with the addresses they are mapped at."""
    wanted = [info.libpython] if info.libpython else []
    found: List[Tuple[str, int]] = []
    with open("/proc/%d/maps" % info.pid) as handle:
        for line in handle:
            parts = line.split(None, 5)
            if len(parts) < 6 or parts[2] != "00000000":
                continue
            path = parts[5].strip()
            if path in wanted or (_LIBC.search(path) and not any(_LIBC.search(p) for p, _ in found)):
                if all(p != path for p, _ in found):
                    found.append((path, int(parts[0].split("-")[0], 16)))
    return found


def _write_code(session: GdbSession, thread: Optional[ThreadState], code: str, deadline: float) -> str:
    """Put ``code`` (NUL-terminated) into a new anonymous page of the target; return its address."""
    data = code.encode() + b"\0"
    out = session.run(_select(thread) + ["call (void*)mmap(0, %d, 3, 34, -1, 0)" % _pages(data)], _left(deadline),
                      calls=True)
    address = _mapped(out)
    with tempfile.NamedTemporaryFile(prefix="probe-code-", suffix=".bin") as handle:
        handle.write(data)
        handle.flush()
        session.run(["restore %s binary %s" % (handle.name, address)], _left(deadline))
    return address


def _select(thread: Optional[ThreadState]) -> List[str]:
    return ["thread %d" % thread.num] if thread is not None else []


def _pages(data: bytes) -> int:
    return (len(data) + 4095) // 4096 * 4096


def _mapped(out: str) -> str:
    """The address gdb printed for the target's mmap; OSError where it failed."""
    match = _ADDRESS.search(out)
    if not match or int(match.group(1), 16) in (0, (1 << 64) - 1):
        raise OSError("mmap in the target failed: %s" % out.strip()[-200:])
    return match.group(1)


def _after_address(out: str) -> str:
    match = _ADDRESS.search(out)
    return out[match.end():] if match else out


def _check_zero(out: str, what: str) -> None:
    match = _INT.search(out)
    if not match or match.group(1) != "0":
        raise OSError("%s failed in the target (the pending-call queue may be full): %s" % (what, out.strip()[-200:]))


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.05)


def can_remote_exec(info: TargetInfo) -> bool:
    """PEP 768 works from a client of the target's own major.minor, on 3.14 and newer."""
    return (info.version is not None and info.version >= (3, 14) and sys.version_info[:2] == info.version
            and hasattr(sys, "remote_exec"))


def inject_with_remote_exec(info: TargetInfo, code: str) -> Plan:  # pragma: no cover - no 3.14 on the test hosts
    """UNTESTED (no Python 3.14 here): ``sys.remote_exec`` runs a file at the target's next safe point."""
    fd, path = tempfile.mkstemp(prefix="probe-bootstrap-", suffix=".py")
    with os.fdopen(fd, "w") as handle:
        handle.write(code)
    if info.uid != os.getuid():
        os.chown(path, info.uid, -1)
    sys.remote_exec(info.pid, path)  # type: ignore[attr-defined]  # the file must stay until read
    return Plan(REMOTE_EXEC, None, None)
