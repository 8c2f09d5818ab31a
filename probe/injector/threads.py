"""What each thread of the stopped target is doing, read from gdb's backtraces and GIL checks.

The injector may run code on a thread only where CPython itself would let other Python code run: a
thread parked in a wait that CPython entered with the GIL released (a lock acquire, ``time.sleep``,
``select``, a socket or file read). There the thread's state is exactly the state in which any other
thread may run Python, so taking the GIL on it (``PyGILState_Ensure``) and running one line is the same
as a C callback. Everywhere else (inside bytecode, inside malloc, inside an unknown C library) it may
not. These are pure functions over gdb's text, so the rules are tested without a process.

Two rules find such a wait. The named one: a CPython function known to wait with the GIL released
(``SAFE_WAIT_SITES``). The general one (:func:`_released_wait`), for any blocking system call entered
through ``Py_BEGIN_ALLOW_THREADS``: libc's frames, innermost, are a blocking call and the waiting
primitives under it (epoll_wait, poll, select, read, a futex wait, ...), and the frame that called
them is either code of a Python extension module (its symbols are not loaded, so gdb names it ``??``;
the library its address lies in says what it is: asyncio's ``select.epoll.poll``, a selector, uvloop,
a Cython ``with nogil`` block) or an interpreter function called straight from the evaluation loop's
call glue (a builtin entered from Python code). Either way the wait was entered by a C function that
Python code called and that let go of the GIL itself; gdb's check that the thread holds no GIL comes on
top. A wait reached through another library (libstdc++, libtorch, libffi) is not taken: that library
may hold locks of its own across the wait.
"""

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["Frame", "ThreadState", "parse_backtraces", "parse_gil_checks", "with_gil", "is_parked_safely",
           "is_waiting_for_gil", "is_in_bytecode", "describe", "SAFE_WAIT_SITES", "wait_site", "with_libraries",
           "is_extension"]

_THREAD = re.compile(r"^Thread (\d+) \((.*)\):\s*$")
_LWP = re.compile(r"LWP (\d+)")
_NAME = re.compile(r'"([^"]*)"\s*\)?\s*$')
_FRAME = re.compile(r"^#(\d+)\s+(?:(0x[0-9a-fA-F]+) in )?(\S+) ")
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
# The general rule (:func:`_released_wait`): libc's blocking calls, one of which must be innermost, and
# the waiting primitives that may stand between it and its caller; names as :func:`_libc_base` reduces them.
_BLOCKING_CALLS = frozenset((
    "epoll_wait", "epoll_pwait", "epoll_pwait2", "poll", "ppoll", "select", "pselect", "pselect6", "read", "readv",
    "pread", "recv", "recvfrom", "recvmsg", "recvmmsg", "accept", "accept4", "connect", "wait4", "waitpid", "waitid",
    "wait", "nanosleep", "clock_nanosleep", "pause", "sigsuspend", "sigtimedwait", "sigwaitinfo", "sigwait",
    "futex_abstimed_wait_common", "futex_abstimed_wait_cancelable", "futex_wait", "do_futex_wait",
    "syscall_cancel_arch", "syscall_cancel", "internal_syscall_cancel"))
_WAIT_FAMILY = frozenset(("pthread_cond_wait", "pthread_cond_timedwait", "pthread_cond_clockwait",
                          "pthread_cond_wait_common", "sem_wait", "sem_timedwait", "sem_clockwait", "sem_wait_slow",
                          "pthread_join", "pthread_clockjoin_ex", "pthread_timedjoin_np", "sleep", "usleep"))
# The interpreter's glue between the evaluation loop and a C function that Python code calls.
_CALL_GLUE = ("vectorcall", "Vectorcall", "cfunction_call", "_PyObject_MakeTpCall", "_PyObject_Call", "PyObject_Call",
              "_PyEval_EvalFrame")
# A Python extension module's file: ``_socket.cpython-311-x86_64-linux-gnu.so``, ``_foo.abi3.so``, ``x.pypy39-pp73.so``.
_EXTENSION = re.compile(r"\.(cpython-[^./]+|abi3|pypy[^./]*)\.so$|/lib-dynload/[^/]+\.so$")
_GIL_WAITS = ("take_gil", "PyEval_RestoreThread", "PyEval_AcquireThread", "_PyThreadState_Attach")
# Where the evaluation loop hands the GIL to a thread that asked for it: a forced switch waits in ``drop_gil``
# (a condition variable) until the other thread has taken it, then the loop takes it back (``take_gil``).
_GIL_DROPS = ("drop_gil", "_PyEval_ReleaseLock", "_PyThreadState_Detach", "detach_thread")
_PENDING_HANDLERS = ("eval_frame_handle_pending", "_Py_HandlePending", "handle_eval_breaker")
_GLUE = ("vectorcall", "Vectorcall", "_PyObject_Call", "PyObject_Call", "call_function", "_PyFunction_")
_C_CALLS = ("vectorcall", "_Call", "call_function", "builtin_", "do_call_core")
# Data that gdb names when an unwind through a library without symbols (libffi under ctypes) goes astray:
# such a "frame" is no function, and a message that named it (``_PyRuntime``) would mislead.
_DATA_SYMBOL = re.compile(r"^(_PyRuntime|_Py_\w*Struct|_?PyExc_\w+|\w+_Type|_Py_\w*Singletons?|_PyOS_\w+Tstate)$")


@dataclass(frozen=True)
class Frame:
    func: str
    address: Optional[int] = None
    library: Optional[str] = None
    """The file mapped at ``address`` (filled in from the target's maps, for frames gdb cannot name)."""


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
            frames.append(Frame(frame.group(3), int(frame.group(2), 16) if frame.group(2) else None))
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
            break
        callers = SAFE_WAIT_SITES[func]
        caller = funcs[i + 1] if i + 1 < len(funcs) else ""
        if callers is None or caller in callers or (caller == "??" and _called_from_python(funcs[i + 1:])):
            return func
        break
    return _released_wait(thread)


def _libc_base(func: str) -> str:
    """libc's names of one call reduced to one: ``__GI___poll``, ``__libc_read``, ``__futex_abstimed_wait_common64``
    -> ``poll``, ``read``, ``futex_abstimed_wait_common``."""
    name = func.lstrip("_")
    for prefix in ("GI_", "libc_", "new_"):
        if name.startswith(prefix):
            name = name[len(prefix):].lstrip("_")
    for suffix in ("_time64", "64"):
        if name.endswith(suffix):
            name = name[:-len(suffix)]
    return name


def is_extension(path: Optional[str]) -> bool:
    """``path`` is a Python extension module's shared object."""
    return bool(path) and _EXTENSION.search(path or "") is not None


def _released_wait(thread: ThreadState) -> Optional[str]:
    """The general rule (the module's docstring): ``"epoll_wait in select.cpython-311-x86_64-linux-gnu.so"``
    or ``"select_epoll_poll (epoll_wait)"`` for a blocking call entered by a C function that Python code
    called, else None."""
    frames = thread.frames[:16]
    if not frames or _libc_base(frames[0].func) not in _BLOCKING_CALLS:
        return None
    k = 1
    while k < len(frames) and _libc_base(frames[k].func) in _BLOCKING_CALLS | _WAIT_FAMILY:
        k += 1
    if k >= len(frames):
        return None
    caller = frames[k]
    call = _libc_base(frames[0].func)
    if caller.func == "??":
        if is_extension(caller.library):
            return "%s in %s" % (call, (caller.library or "").rsplit("/", 1)[-1])
        return None
    above = frames[k + 1].func if k + 1 < len(frames) else ""
    if caller.func.startswith(("_Py", "Py", "eval_", "__")) or "gil" in caller.func.lower():
        return None  # the interpreter's own machinery (an import lock, the GIL), not a builtin Python code called
    if any(glue in above for glue in _CALL_GLUE):
        return "%s (%s)" % (caller.func, call)
    return None


def with_libraries(threads: Sequence[ThreadState], regions: Sequence[Tuple[int, int, str]]) -> List[ThreadState]:
    """Each frame gdb could not name gets the file mapped at its address (``regions``: start, end, path)."""
    def library(address: Optional[int]) -> Optional[str]:
        if address is None:
            return None
        return next((path for start, end, path in regions if start <= address < end), None)

    return [ThreadState(t.num, t.lwp, t.name, tuple(Frame(f.func, f.address, library(f.address)) if f.func == "??" else f
                                                     for f in t.frames), t.holds_gil) for t in threads]


def _called_from_python(funcs: Sequence[str]) -> bool:
    """A stripped interpreter hides static callers (``acquire_timed`` shows as ``??``); accept them only
    when the first named frame above is the machinery that calls a Python-level method."""
    named = next((f for f in funcs if f != "??"), "")
    return named.startswith("_PyEval_EvalFrame") or "vectorcall" in named.lower() or named.startswith("_PyObject_")


def is_parked_safely(thread: ThreadState) -> bool:
    """Blocked in a known wait entered with the GIL released, and gdb confirmed it holds no GIL."""
    return thread.holds_gil is False and wait_site(thread) is not None


def is_waiting_for_gil(thread: ThreadState) -> bool:
    """Taking the GIL back, or handing it over between two bytecodes: it runs bytecode again within a switch
    interval, so a pending call will run soon."""
    return thread.holds_gil is not True and (any(f in _GIL_WAITS for f in thread.funcs(8)) or _is_switching(thread))


def _is_switching(thread: ThreadState) -> bool:
    """In ``drop_gil`` because the evaluation loop was asked for the GIL, not because a C call released it:
    between the drop and the evaluation loop there is only the pending-request handler."""
    funcs = thread.funcs(10)
    drop = next((k for k, f in enumerate(funcs) if f in _GIL_DROPS), None)
    if drop is None:
        return False
    for func in funcs[drop + 1:]:
        if func.startswith("_PyEval_EvalFrame"):
            return True
        if func not in _GIL_DROPS and func not in _PENDING_HANDLERS:
            return False  # PyEval_SaveThread, a C call's own release: a blocking call, not a switch
    return False


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
