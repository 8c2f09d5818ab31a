"""Stacks of a live process, read by py-spy (its ``dump --json``), for the live reads.

Why py-spy here and pystack for core files: on a live process py-spy reads Python thread names and
idents (pystack sees only OS names), and its ``--native`` stops the process for far less time (65
threads 30 frames deep, longest pause of a busy main loop: py-spy 58 ms, pystack 413 ms, measured by
``bench/bench_pause.py --native``). Its ``--core`` fails on a CPython built with a shared libpython,
which pystack reads. py-spy is a static binary, found next to this Python or on PATH.
"""

import json
from typing import Any, Dict, List, Optional

from probe.errors import ReaderError
from probe.reader import ahead, proc
from probe.reader.stacks import OutsideFrame, Stacks, ThreadStack, how_read

__all__ = ["read_live", "binary"]

TIMEOUT_S = 20.0


def binary() -> Optional[str]:
    """The py-spy executable: beside this interpreter (a venv's bin) or on PATH."""
    return ahead.which("py-spy")


def read_live(pid: int, native: bool = False, stop: bool = True) -> Stacks:
    """Every thread of ``pid``. With ``stop`` (or ``native``) the process is stopped for the read, as
    py-spy does by default, so that every stack is one the program was in; without, it is read as it
    runs (``--nonblocking``), and a thread running Python may show a stack torn by a call or a return
    made during the read. A process stopped already (SIGSTOP) is read without ``stop``: py-spy fails to
    stop it again, and nothing in it moves."""
    exe = binary()
    if exe is None:
        raise ReaderError("reading a process from outside needs py-spy, which is not installed here",
                          hint="pip install py-spy")
    # The read probe.cli.quick started where it saw no agent, of a process that was not stopped then: that read
    # stops it now (state t), which must not pass for a stop of the user's.
    running = ahead.take(ahead.dump_argv(exe, pid)) if stop and not native else None
    stopped = running is None and proc.state(pid) in ("T", "t")
    stop = (stop or native) and not stopped
    argv = ahead.dump_argv(exe, pid, native, stop)
    try:
        if running is None:
            running = ahead.Pending(argv)
        code, out, err = running.result(TIMEOUT_S)
    except TimeoutError:
        raise ReaderError("py-spy did not read process %d within %.0f s" % (pid, TIMEOUT_S)) from None
    except OSError as exc:
        raise ReaderError("cannot run %s: %s" % (exe, exc.strerror or exc)) from None
    if code != 0:
        raise _explain(pid, err)
    try:
        raw = json.loads(out)
    except ValueError:
        raise ReaderError("py-spy gave an answer that is not JSON for process %d" % pid) from None
    threads = tuple(_thread(t, pid) for t in raw if isinstance(t, dict))
    return Stacks(pid, "read from outside the live process by py-spy, %s" % how_read(stop, stopped, native),
                  threads, None, {"native": native, "consistent": stop or stopped, "live": True})


def _thread(raw: Dict[str, Any], pid: int) -> ThreadStack:
    frames: List[OutsideFrame] = []
    for f in raw.get("frames") or []:
        if f.get("module"):  # a native frame: module is its shared object
            frames.append(OutsideFrame(str(f.get("name")), str(f.get("filename") or f.get("module")),
                                       int(f.get("line") or 0), "native", f.get("short_filename")))
        else:
            frames.append(OutsideFrame(str(f.get("name")), str(f.get("filename")), int(f.get("line") or 0)))
    native_id = raw.get("os_thread_id")
    name = raw.get("thread_name")
    return ThreadStack(native_id, raw.get("thread_id"), name, native_id == pid, tuple(frames),
                       bool(raw.get("owns_gil")), False, bool(name and str(name).startswith("probe-")))


def _explain(pid: int, stderr: str) -> ReaderError:
    text = " ".join(line.strip() for line in stderr.strip().splitlines()[:2]) or "py-spy failed"
    lowered = text.lower()
    if "no such process" in lowered or proc.state(pid) is None:
        return ReaderError("no process with pid %d" % pid, hint="check the pid with `probe list` or ps")
    if "python version" in lowered or "executable name" in lowered or "python interpreter" in lowered:
        return ReaderError("process %d (%s) shows no Python interpreter that can be read" % (pid, proc.comm(pid) or "?"),
                           hint="is it a Python process? (one just starting or shutting down has none yet)")
    if "permission" in lowered or "operation not permitted" in lowered:
        why, hint = proc.ptrace_denied_reason(pid)
        return ReaderError("not allowed to read process %d from outside: %s" % (pid, why), hint=hint)
    if proc.state(pid) in ("T", "t"):
        return ReaderError("py-spy could not read process %d, which is %s: %s" % (pid, proc.STATE_WORDS[proc.state(pid) or "T"],
                                                                              text[:300].strip()),
                           hint="`kill -CONT %d` resumes it; pystack (pip install pystack) reads it as it is" % pid)
    return ReaderError("py-spy could not read process %d from outside: %s" % (pid, text[:300].strip()))
