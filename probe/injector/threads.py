"""What each thread of the stopped target is doing, read from gdb's backtraces and GIL checks.

The injector may run code on a thread only where CPython itself would let other Python code run: a
thread parked in a wait that CPython entered with the GIL released (a lock acquire, ``time.sleep``,
``select``, a socket or file read). There the thread's state is exactly the state in which any other
thread may run Python, so taking the GIL on it (``PyGILState_Ensure``) and running one line is the same
as a C callback. Everywhere else (inside bytecode, inside malloc, inside an unknown C library) it may
not. These are pure functions over gdb's text, so the rules are tested without a process.
"""

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["Frame", "ThreadState", "parse_backtraces", "parse_gil_checks", "with_gil", "is_parked_safely",
           "is_waiting_for_gil", "is_in_bytecode", "describe", "SAFE_WAIT_SITES"]

_THREAD = re.compile(r"^Thread (\d+) \((.*)\):\s*$")
_LWP = re.compile(r"LWP (\d+)")
_NAME = re.compile(r'"([^"]*)"\s*\)?\s*$')
_FRAME = re.compile(r"^#(\d+)\s+(?:0x[0-9a-fA-F]+ in )?(\S+) ")
_VALUE = re.compile(r"^\$\d+ = (-?\d+)")

# Where a thread waits with the GIL released, and which callers prove that (None: any caller).
SAFE_WAIT_SITES: Dict[str, Optional[Tuple[str, ...]]] = {
    # threading.Lock/RLock/Event/Condition/Queue/Thread.join: _thread's lock acquire.
    "PyThread_acquire_lock_timed": ("acquire_timed", "lock_PyThread_acquire_lock", "rlock_acquire",
                                    "PyThread_acquire_lock_timed_with_retries"),
    "PyThread_acquire_lock_timed_with_retries": ("acquire_timed", "lock_PyThread_acquire_lock", "rlock_acquire",
                                                 "lock_acquire_parse_args"),
    "pysleep": None,  # time.sleep
    "select_select_impl": None,
    "select_poll_poll_impl": None,
    "select_epoll_poll_impl": None,
    "sock_call_ex": None,
    "_Py_read": None,
    "os_waitpid_impl": None,
    "os_wait_impl": None,
}
# Read from symbol tables alone (no debug information: ``symbols``), a wait site the compiler inlined
# has no frame of its own: its caller stands right above libc's frames, and stands for it.
_INLINED_INTO = {"time_sleep": "pysleep", "os_waitpid": "os_waitpid_impl", "os_wait": "os_wait_impl"}
# Frames inside libc's waiting primitives, below the CPython function that called them.
_LIBC_PREFIXES = ("__", "do_futex_wait", "futex_", "sem_", "pthread_cond_", "clock_nanosleep", "nanosleep",
                  "select", "poll", "ppoll", "epoll_wait", "read", "recv", "accept", "wait4", "waitpid", "waitid")
_GIL_WAITS = ("take_gil", "PyEval_RestoreThread", "PyEval_AcquireThread", "_PyThreadState_Attach")
_GLUE = ("vectorcall", "Vectorcall", "_PyObject_Call", "PyObject_Call", "call_function", "_PyFunction_")
_C_CALLS = ("vectorcall", "_Call", "call_function", "builtin_", "do_call_core")
# Data that gdb names when an unwind through a library without symbols (libffi under ctypes) goes astray:
# such a "frame" is no function, and a message that named it (``_PyRuntime``) would mislead.
_DATA_SYMBOL = re.compile(r"^(_PyRuntime|_Py_\w*Struct|_?PyExc_\w+|\w+_Type|_Py_\w*Singletons?|_PyOS_\w+Tstate)$")


@dataclass(frozen=True)
class Frame:
    func: str


@dataclass(frozen=True)
class ThreadState:
    """One thread as gdb saw it: gdb's number, the kernel's id, frames innermost first, GIL flag."""

    num: int
    lwp: int
    name: str
    frames: Tuple[Frame, ...]
    holds_gil: Optional[bool] = None

    def funcs(self, depth: int = 12) -> List[str]:
        return [f.func for f in self.frames[:depth]]


def parse_backtraces(text: str) -> List[ThreadState]:
    """``thread apply all bt N`` output -> threads (gdb's order)."""
    threads: List[ThreadState] = []
    current: Optional[Tuple[int, int, str]] = None
    frames: List[Frame] = []
    for line in text.splitlines():
        header = _THREAD.match(line)
        if header:
            if current:
                threads.append(ThreadState(current[0], current[1], current[2], tuple(frames)))
            lwp = _LWP.search(header.group(2))
            name = _NAME.search(header.group(2))
            current = (int(header.group(1)), int(lwp.group(1)) if lwp else 0, name.group(1) if name else "")
            frames = []
            continue
        frame = _FRAME.match(line)
        if frame and current:
            frames.append(Frame(frame.group(2)))
    if current:
        threads.append(ThreadState(current[0], current[1], current[2], tuple(frames)))
    return threads


def parse_gil_checks(text: str) -> Dict[int, bool]:
    """``thread apply all call (int)PyGILState_Check()`` output -> {gdb thread number: holds the GIL}."""
    result: Dict[int, bool] = {}
    num: Optional[int] = None
    for line in text.splitlines():
        header = _THREAD.match(line)
        if header:
            num = int(header.group(1))
            continue
        value = _VALUE.match(line)
        if value and num is not None:
            result[num] = value.group(1) != "0"
            num = None
    return result


def with_gil(threads: Sequence[ThreadState], checks: Dict[int, bool]) -> List[ThreadState]:
    return [ThreadState(t.num, t.lwp, t.name, t.frames, checks.get(t.num)) for t in threads]


def _is_libc(func: str) -> bool:
    return func.startswith(_LIBC_PREFIXES) and not func.startswith("_Py") and func not in SAFE_WAIT_SITES


def wait_site(thread: ThreadState) -> Optional[str]:
    """The CPython function the thread waits in, when it is a known GIL-released wait; else None."""
    funcs = thread.funcs()
    for i, func in enumerate(funcs):
        if _is_libc(func):
            continue
        if i and func in _INLINED_INTO:
            return _INLINED_INTO[func]
        if func not in SAFE_WAIT_SITES:
            return None
        callers = SAFE_WAIT_SITES[func]
        caller = funcs[i + 1] if i + 1 < len(funcs) else ""
        if callers is None or caller in callers or (caller == "??" and _called_from_python(funcs[i + 1:])):
            return func
        return None
    return None


def _called_from_python(funcs: Sequence[str]) -> bool:
    """A stripped interpreter hides static callers (``acquire_timed`` shows as ``??``); accept them only
    when the first named frame above is the machinery that calls a Python-level method."""
    named = next((f for f in funcs if f != "??"), "")
    return named.startswith("_PyEval_EvalFrame") or "vectorcall" in named.lower() or named.startswith("_PyObject_")


def is_parked_safely(thread: ThreadState) -> bool:
    """Blocked in a known wait entered with the GIL released, and gdb confirmed it holds no GIL."""
    return thread.holds_gil is False and wait_site(thread) is not None


def is_waiting_for_gil(thread: ThreadState) -> bool:
    return thread.holds_gil is not True and any(f in _GIL_WAITS for f in thread.funcs(8))


def is_in_bytecode(thread: ThreadState) -> bool:
    """Executing bytecode, not inside a call to a C function: it will drop the GIL within a switch interval.

    A heuristic (a C function may be inlined out of sight); it errs towards "in a C call".
    """
    for func in thread.funcs(6):
        if func.startswith("_PyEval_EvalFrame"):
            return True
        if any(part in func for part in _C_CALLS) or _is_libc(func) or func == "??":
            return False
    return False


def describe(thread: ThreadState) -> str:
    """``thread 1 (LWP 4242 "python") in builtin_sum (innermost: pymalloc_alloc)`` for messages.

    Names the C function that the Python code called (the frame under the eval loop, glue skipped),
    which is what a user recognises, and the innermost frame.
    """
    funcs = thread.funcs(16)
    entry = ""
    for func in funcs:
        if func.startswith("_PyEval_EvalFrame"):
            break
        if func != "??" and not any(glue in func for glue in _GLUE) and not _DATA_SYMBOL.match(func):
            entry = func
    innermost = funcs[0] if funcs else "?"
    where = "%s (innermost: %s)" % (entry, innermost) if entry and entry != innermost else innermost
    return 'thread %d (LWP %d "%s") in %s' % (thread.num, thread.lwp, thread.name, where)
