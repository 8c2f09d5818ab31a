"""The crash record: a process with an agent that dies of a fatal signal or an uncaught exception
leaves every thread's last stack in ``<runtime dir>/<pid>-<start>.crash``.

At a fatal signal (SIGSEGV, SIGBUS, SIGFPE, SIGABRT, SIGILL) nothing but async-signal-safe work is
possible, so the stacks are written by the interpreter's own ``faulthandler`` into a file opened at
agent start; faulthandler then restores the previous handler and raises the signal again, so the exit
status, a core dump and any earlier handler (a C library's own) are what they would have been. An
uncaught exception is recorded from ``sys.excepthook`` (chained to the one that was there). A clean
exit removes the file; a kill that leaves no chance to write (SIGKILL, the OOM killer) leaves the
header only, which is a record too: "ended without a word".

SIGTERM runs no Python handler (installing one would change the program: a main thread blocked in C
would never see it). Where SIGTERM's disposition is the default one (nobody catches or ignores it),
faulthandler is registered for it with ``chain=True``: its C handler writes every thread's stack into
the record, puts the default action back and raises SIGTERM again, so the process dies of SIGTERM with
the same exit status as without probe. A program that sets its own SIGTERM handler later replaces it.

When the program has already enabled faulthandler for itself (``-X faulthandler``,
``PYTHONFAULTHANDLER``), it keeps it: its stacks go where it sent them, and the header says so.

The record's descriptor is the program's to close: a program that closes every descriptor it does not
know, and opens its own, may get the record's number. faulthandler would then write the stacks into the
program's file. So the record is known by its inode: :func:`check` (the agent's accept thread calls it
every beat) finds the number taken, lets it go (never closes it: it is the program's now), and opens the
record again on a number of its own; the exception hook and the exit hook look first too.

The file starts with ``key value`` lines, then a line ``---``, then what faulthandler or the exception
hook wrote. ``probe.reader.crash`` reads it. Runs inside the target: stdlib only, Python 3.9+.
"""

import faulthandler
import os
import signal
import sys
import threading
import time
from typing import IO, Any, Optional, Tuple

from probe import _paths

__all__ = ["install", "check", "MAGIC", "SEPARATOR"]

MAGIC = "probe-crash-record 1"
SEPARATOR = "---"

_file: Optional[IO[str]] = None  # over ``_fd``, which it never closes (closefd=False): we close it ourselves
_fd = -1
_ident: Optional[Tuple[int, int]] = None  # (st_dev, st_ino) of the record: whether ``_fd`` still refers to it
_path: Optional[str] = None
_pid = 0
_keep = False
_ours = False
_sigterm = False


def install() -> Optional[str]:
    """Open this process's record and arm the handlers; returns its path (None where it cannot be)."""
    global _file, _fd, _ident, _path, _pid, _ours
    if _file is not None and _pid == os.getpid():
        return _path
    try:
        ticks = _paths.process_start_ticks()
        path = _paths.crash_record_path(os.getpid(), ticks)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except (OSError, ValueError, IndexError):
        return None
    try:
        info = os.fstat(fd)
        handle = open(fd, "w", encoding="utf-8", errors="replace", closefd=False)
    except (OSError, ValueError):
        os.close(fd)
        return None
    preexisting = faulthandler.is_enabled()
    sigterm = not preexisting and _sigterm_is_default()
    main = threading.main_thread().ident or 0
    try:
        command = open("/proc/self/cmdline", "rb").read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        command = " ".join(sys.argv)
    agent_threads = ",".join("0x%016x" % (t.ident or 0) for t in threading.enumerate() if t.name.startswith("probe-"))
    header = [MAGIC, "pid %d" % os.getpid(), "start_ticks %d" % ticks, "started_at %.3f" % time.time(),
              "main_thread 0x%016x" % main, "agent_threads %s" % agent_threads, "python %s" % sys.version.split()[0],
              "faulthandler %s" % ("program" if preexisting else "probe"), "sigterm %s" % ("stacks" if sigterm else "-"),
              "command %s" % command.strip().replace("\n", " ")[:2000], SEPARATOR]
    handle.write("\n".join(header) + "\n")
    handle.flush()
    _file, _fd, _ident, _path, _pid = handle, fd, (info.st_dev, info.st_ino), path, os.getpid()
    if not preexisting:
        faulthandler.enable(file=handle, all_threads=True)
        _ours = True
    if sigterm:
        _register_sigterm(handle)
    previous = sys.excepthook
    sys.excepthook = _ExceptHook(previous)
    import atexit

    atexit.register(_remove_at_exit)
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_forget_in_child)
    return path


class _ExceptHook:
    """Records an uncaught exception, then hands it to the hook that was installed before."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous

    def __call__(self, kind: Any, value: Any, tb: Any) -> None:
        global _keep
        try:
            check()
            if _file is not None and _pid == os.getpid():
                import traceback

                _keep = True
                summary = "".join(traceback.format_exception_only(kind, value)).strip().replace("\n", " ")
                _file.write("Uncaught exception: %s\n" % summary[:2000])
                _file.write("".join(traceback.format_exception(kind, value, tb)) + "\n")
                # Where it was raised, in faulthandler's own format (this thread's stack has unwound by
                # now); then every thread, as faulthandler sees them (a reader keeps a thread's first block).
                _file.write("Current thread 0x%016x (most recent call first):\n" % threading.get_ident())
                for entry in reversed(traceback.extract_tb(tb)):
                    _file.write('  File "%s", line %s in %s\n' % (entry.filename, entry.lineno, entry.name))
                _file.write("\n")
                _file.flush()
                faulthandler.dump_traceback(file=_file, all_threads=True)
                _file.flush()
        except Exception:
            pass
        self.previous(kind, value, tb)


def check() -> None:
    """Whether the record's descriptor still refers to the record; if the program took its number, let the
    number go and open the record again (appending: the header stays) with the same handlers. Never raises."""
    global _file, _fd, _ours
    if _file is None or _pid != os.getpid() or _same_file(_fd):
        return
    had_sigterm = _sigterm
    try:
        if _ours:
            faulthandler.disable()  # first of all: no fatal signal may write into the program's file now
        _unregister_sigterm()
    except Exception:
        pass
    _file, _fd = None, -1  # never closed: the number is the program's
    try:
        fd = os.open(_path or "", os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return  # removed meanwhile: no record any more
    if not _same_file(fd, _ident):
        os.close(fd)  # not our record (replaced): write nothing there
        return
    try:
        handle = open(fd, "w", encoding="utf-8", errors="replace", closefd=False)
        _file, _fd = handle, fd
        if _ours:
            faulthandler.enable(file=handle, all_threads=True)
        if had_sigterm and _sigterm_is_default():  # unless the program has set its own SIGTERM handler since
            _register_sigterm(handle)
    except Exception:
        _ours = False


def _same_file(fd: int, ident: Optional[Tuple[int, int]] = None) -> bool:
    try:
        info = os.fstat(fd)
    except (OSError, ValueError, OverflowError):
        return False
    return (info.st_dev, info.st_ino) == (ident or _ident)


def _remove_at_exit() -> None:
    """A clean exit leaves nothing behind; an exit after an uncaught exception keeps the record."""
    global _file
    check()
    if _pid != os.getpid() or _file is None:
        return
    if _keep:
        return
    try:
        if _ours:
            faulthandler.disable()
        _unregister_sigterm()
        _file.close()  # the handle only (closefd=False); the number is checked, then closed
        _file = None
        if _same_file(_fd):
            os.close(_fd)
        if _path:
            os.unlink(_path)
    except Exception:
        pass


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) must not write its crash into its parent's record."""
    global _file, _ours
    if _file is None:
        return
    try:
        if _ours:
            faulthandler.disable()
        _unregister_sigterm()
    except Exception:
        pass
    _ours = False
    _file = None  # the parent's handle: never closed here (the buffer is empty: every write flushes)


def _sigterm_is_default() -> bool:
    """Whether SIGTERM would kill this process now: neither caught (by Python or a C library) nor ignored."""
    try:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return False
        with open("/proc/self/status", "rb") as handle:
            status = handle.read().decode("ascii", "replace")
    except (OSError, ValueError):
        return False
    bit = 1 << (signal.SIGTERM - 1)
    masks = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("SigCgt", "SigIgn"):
            masks[key] = int(value.strip(), 16)
    return len(masks) == 2 and not any(mask & bit for mask in masks.values())


def _register_sigterm(handle: IO[str]) -> None:
    global _sigterm
    try:
        faulthandler.register(signal.SIGTERM, file=handle, all_threads=True, chain=True)
        _sigterm = True
    except (AttributeError, OSError, RuntimeError, ValueError):
        pass


def _unregister_sigterm() -> None:
    """Take our SIGTERM handler away (before the record's file closes, and in a forked child), unless the
    program has set its own SIGTERM handler since: that one replaced ours, and must stay."""
    global _sigterm
    if not _sigterm:
        return
    _sigterm = False
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        faulthandler.unregister(signal.SIGTERM)
