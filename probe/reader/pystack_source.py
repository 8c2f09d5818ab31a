"""Stacks of a live process or a core file, read by pystack.

Why pystack (a dependency of the client, never of the target): one library reads live processes
(without stopping them, or stopped for native frames) and core files, reports per thread whether it
holds the GIL and whether it is collecting garbage, and gives native frames with file and line, all
through a Python API, so a read costs no process start (about 25-40 ms here). py-spy, the other
maintained reader, reads live processes as fast and its ``--native`` pauses like pystack's, but its
``--core`` fails on a CPython built with a shared libpython (this machine's pyenv builds): "failed to
get python version".
"""

import os
from typing import Any, List, Optional, Tuple

from probe.errors import ReaderError
from probe.reader import proc
from probe.reader.stacks import OutsideFrame, Stacks, ThreadStack, how_read

__all__ = ["read_live", "read_core", "available"]


def available() -> bool:
    try:
        import pystack.engine  # noqa: F401
    except ImportError:
        return False
    return True


def _engine() -> Any:
    try:
        import pystack.engine as engine
    except ImportError:
        raise ReaderError("reading a process from outside needs pystack, which is not installed here",
                          hint="pip install pystack (Linux)") from None
    return engine


def read_live(pid: int, native: bool = False, stop: bool = True) -> Stacks:
    """Every thread of live process ``pid``. With ``stop`` or ``native`` it is stopped for the read
    (tens of milliseconds): every stack is one the program was in, and native stacks need it. Without,
    a thread running Python may show a stack torn by a call or a return made during the read."""
    engine = _engine()
    mode = engine.NativeReportingMode.PYTHON if native else engine.NativeReportingMode.OFF
    stopped = proc.state(pid) == "T"  # SIGSTOP or Ctrl-Z: it stays stopped after the read
    stop = stop or native
    try:
        threads = engine.get_process_threads(pid, stop_process=stop, native_mode=mode)
    except Exception as exc:
        raise _explain(exc, pid) from None
    names = proc.thread_names(pid)
    comm = proc.comm(pid)
    if stopped:
        source = "read from outside the stopped process by pystack (it stays stopped; `kill -CONT %d` resumes it)" % pid
    else:
        source = "read from outside the live process by pystack, %s" % how_read(stop, False, native)
    return Stacks(pid, source, tuple(_convert(t, pid, names, comm, native) for t in threads),
                  _version(threads), {"native": native, "consistent": stop or stopped, "live": True})


def read_core(path: str, executable: Optional[str] = None, native: bool = False) -> Stacks:
    """Every thread of the process that a core file holds; the executable is found in the core
    unless given."""
    engine = _engine()
    if not os.path.isfile(path):
        raise ReaderError("no core file at %s" % path, hint="give the path of a core file: core:PATH")
    try:
        analyzer = engine.CoreFileAnalyzer(path, executable)
        executable = executable or str(analyzer.extract_executable())
        pid = int(analyzer.extract_pid())
        failure = _safe(analyzer.extract_failure_info) or {}
    except Exception as exc:
        raise _explain(exc, None, core=path) from None
    if not os.path.exists(executable):
        raise ReaderError("the core file names the executable %s, which is not on this host" % executable,
                          hint="give the Python executable that made it: --executable PATH")
    mode = engine.NativeReportingMode.PYTHON if native else engine.NativeReportingMode.OFF
    try:
        threads = engine.get_process_threads_for_core(path, executable, native_mode=mode)
    except Exception as exc:
        raise _explain(exc, None, core=path) from None
    signal_number = failure.get("si_signo")
    facts = {"executable": executable, "signal": _signal_name(signal_number), "native": native, "core": path}
    return Stacks(pid, "core file %s (executable %s)" % (path, executable),
                  tuple(_convert(t, pid, {}, None, native) for t in threads), _version(threads), facts)


def _convert(thread: Any, pid: int, names: dict, comm: Optional[str], native: bool) -> ThreadStack:
    python = [f for f in thread.frames]  # outermost first, shim frames left out
    frames = _interleave(thread, python) if native else None
    if frames is None:
        frames = [_python_frame(f) for f in python]
    frames.reverse()  # innermost first, as python.backtrace has them
    tid = int(thread.tid)
    os_name = names.get(tid) or getattr(thread, "name", None)
    is_agent = bool(os_name and os_name.startswith("probe-"))
    if tid == pid:
        name: Optional[str] = "MainThread"
    elif os_name and os_name != comm and not os_name.startswith("python"):
        name = os_name
    else:
        name = None
    gc = getattr(thread, "is_gc_collecting", -1) == 1
    return ThreadStack(tid, None, name, tid == pid, tuple(frames), bool(thread.holds_the_gil > 0), gc, is_agent)


def _python_frame(frame: Any) -> OutsideFrame:
    return OutsideFrame(frame.code.scope, frame.code.filename, int(frame.code.location.lineno), "python")


def _interleave(thread: Any, python: List[Any]) -> Optional[List[OutsideFrame]]:
    """Native and Python frames in one stack, outermost first: each evaluation-loop frame of the native
    stack stands for the run of Python frames that one C-level call of the interpreter executed (a run
    starts at an "entry" frame). None when the two do not match up (then Python frames only)."""
    from pystack.types import NativeFrame, frame_type

    runs: List[List[Any]] = []
    for frame in python:
        if frame.is_entry or not runs:
            runs.append([frame])
        else:
            runs[-1].append(frame)
    version = thread.python_version
    kinds = [(n, frame_type(n, version)) for n in thread.native_frames]
    if sum(1 for _, kind in kinds if kind == NativeFrame.FrameType.EVAL) != len(runs):
        return None
    out: List[OutsideFrame] = []
    for native, kind in kinds:
        if kind == NativeFrame.FrameType.EVAL:
            out.extend(_python_frame(f) for f in runs.pop(0))
        elif kind == NativeFrame.FrameType.OTHER:
            library = os.path.basename(native.library or "") or None
            where = native.path if native.path and native.path != "???" else (native.library or "")
            out.append(OutsideFrame(native.symbol or "0x%x" % native.address, where, int(native.linenumber or 0),
                                    "native", library))
    return out


def _version(threads: List[Any]) -> Optional[str]:
    for thread in threads:
        if thread.python_version:
            return "%d.%d" % tuple(thread.python_version)[:2]
    return None


def _safe(fn: Any) -> Any:
    try:
        return fn()
    except Exception:
        return None


def _signal_name(number: Any) -> Optional[str]:
    if not isinstance(number, int) or number <= 0:
        return None
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return "signal %d" % number


def _explain(exc: Exception, pid: Optional[int], core: Optional[str] = None) -> ReaderError:
    """pystack's exceptions, as one line that says what to do."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    kind = type(exc).__name__
    if core is not None:
        if kind in ("CoreExecutableNotFound", "DetectedExecutableNotFound", "InvalidExecutable"):
            return ReaderError("cannot find the executable that made core file %s: %s" % (core, text),
                               hint="give it: --executable /path/to/python")
        return ReaderError("cannot read the Python stacks in core file %s: %s" % (core, text),
                           hint="is it the core of a Python process, made on this host (same libraries)?")
    if isinstance(exc, ProcessLookupError) or kind == "ProcessNotFound":
        return ReaderError("no process with pid %s" % pid, hint="check the pid with `probe list` or ps")
    if isinstance(exc, PermissionError) or "ermission" in text or "ptrace" in text.lower():
        why, hint = proc.ptrace_denied_reason(pid or 0)
        return ReaderError("not allowed to read process %s from outside: %s" % (pid, why), hint=hint)
    if kind in ("InvalidPythonProcess", "NotEnoughInformation"):
        return ReaderError("process %s shows no Python interpreter that can be read: %s" % (pid, text),
                           hint="is it a Python process? (one shutting down, or not yet started, has none)")
    return ReaderError("reading process %s from outside failed: %s" % (pid, text))


def stack_signature(stacks: Stacks) -> Tuple[Any, ...]:
    """What changes when any thread moves: to tell a stuck process from one that runs."""
    return tuple((t.native_id, tuple((f.func, f.lineno) for f in t.frames)) for t in stacks.threads)
