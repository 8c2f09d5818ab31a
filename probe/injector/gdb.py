"""One gdb attached to the target, driven command by command under hard time limits.

gdb reads commands from a pipe and writes to a file; after each batch it echoes a marker, so the
injector can look at what it saw (threads, backtraces, who holds the GIL) before it decides what to
call. Two rules keep the target safe:

* Outside a call into the target, a gdb that overruns its time is killed, and the target gets SIGCONT
  (ptrace detaches on the tracer's death; SIGCONT clears a stop that gdb's attach may have left).
* A call into the target that may wait (``PyGILState_Ensure``) is sent together with ``detach`` and
  ``quit``. If it overruns, gdb is left to finish on its own, because killing gdb while the target
  executes a call it made leaves the thread returning into gdb's dummy frame, which crashes it.
"""

import os
import re
import signal
import subprocess
import tempfile
import time
from typing import List, Optional, Sequence, Tuple

from probe.injector.symbols import symbol_files
from probe.injector.xstate import gdb_environment

__all__ = ["GdbSession", "GdbError", "GdbTimeout", "GdbAbandoned", "abandoned_gdbs", "finish_detached"]

_CALLED = ("mmap", "Py_AddPendingCall", "PyRun_SimpleString", "PyGILState_Check", "PyGILState_Ensure",
           "PyGILState_Release")
_SETUP = (
    "set pagination off",
    "set confirm off",
    "set width 0",
    "set height 0",
    "set print thread-events off",
    "set print inferior-events off",
    # Loading every shared library's symbols costs seconds in a torch process; load only what we call.
    "set auto-solib-add off",
    # A signal arriving during one of our calls is passed to the target, and does not stop the call.
    "handle all nostop noprint pass",
    "set unwindonsignal on",
)
_ABANDONED: List["subprocess.Popen[bytes]"] = []
_DETACHED: List["subprocess.Popen[bytes]"] = []  # gdbs that detached and are exiting: see finish_detached
_CALL_GRACE = 2.0  # seconds a call that overran gets to return before gdb is left to finish alone


class GdbError(Exception):
    """gdb failed; ``output`` is what it printed."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output


class GdbTimeout(GdbError):
    """gdb did not finish a step in time; it was killed and the target continued. ``step``: which one
    (the time it was given is what was left of the injection's whole budget, not a figure of its own)."""

    def __init__(self, message: str, output: str = "", step: str = "") -> None:
        super().__init__(message, output)
        self.step = step


class GdbAbandoned(GdbError):
    """A call into the target overran; gdb was left to finish it and detach by itself."""


def finish_detached(timeout: float = 2.0) -> None:
    """Reap the gdbs that have detached from their targets and were left exiting (their exit, ~10-50 ms,
    overlaps the wait for the agent); one that has not exited within ``timeout`` is killed (it traces
    nothing any more)."""
    while _DETACHED:
        proc = _DETACHED.pop()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def abandoned_gdbs() -> List["subprocess.Popen[bytes]"]:
    """gdbs left finishing a call (reaped here once they have exited)."""
    _ABANDONED[:] = [p for p in _ABANDONED if p.poll() is None]
    return list(_ABANDONED)


class GdbSession:
    """gdb attached to ``pid`` with symbols of only ``libraries`` ((path, load address) pairs) and of
    ``executable`` (a path to the target's executable: ``/proc/PID/exe``); ``then``: commands run right
    after the attach, their output in ``attached_output``."""

    def __init__(self, pid: int, libraries: Sequence[Tuple[str, int]], timeout: float, gdb: str = "gdb",
                 executable: str = "", then: Sequence[str] = ()) -> None:
        self.pid = pid
        self._counter = 0
        _DETACHED[:] = [p for p in _DETACHED if p.poll() is None]
        env = gdb_environment()  # before anything is opened: it may refuse (InjectError)
        # gdb appends to its own open file; we read through another, so the two never share an offset.
        fd, path = tempfile.mkstemp(prefix="probe-gdb-", suffix=".log")
        try:
            sink = open(path, "ab")
            self._log = open(path, "rb")
        finally:
            os.close(fd)
            os.unlink(path)
        self._read_pos = 0
        began = time.monotonic()
        with sink:
            self._proc = subprocess.Popen(
                [gdb, "-nx", "-q", "-iex", "set debuginfod enabled off", "-iex", "set auto-load off"],
                stdin=subprocess.PIPE, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                env=env)
        # Symbols are read before attaching, at the addresses the target mapped the libraries at, so the
        # target stays stopped only for the look and the calls. They come from copies without debug
        # information where these can be had (``symbols``): function names and unwind tables are all gdb
        # needs here, and reading libpython's and libc's DWARF was most of the time. Worked out while gdb
        # starts.
        try:
            files = symbol_files(libraries, timeout, executable)
        except BaseException:
            self._kill()
            raise
        self.lean_symbols = files.lean
        commands = list(_SETUP) + files.commands
        commands += ["add-symbol-file -o %#x %s" % (base, path) for path, base in files.libraries]
        # Looking up the functions we may call, before attaching, takes the first call's one-time cost
        # (about 40 ms here) out of the time the target is stopped.
        commands += ["print (void*)%s" % name for name in _CALLED]
        # ``then`` (the look at the threads) runs in the same batch: no round trip through the injector
        # between the attach and the look, while the target is stopped.
        commands.append("attach %d" % pid)
        commands += then
        out = self.run(commands, max(timeout - (time.monotonic() - began), 0.05))
        self.attached_output = out  # what gdb printed as it attached and ran ``then``
        if "ptrace:" in out or "Can't attach" in out or "Could not attach" in out:
            self._kill()
            raise GdbError("gdb could not attach to process %d: %s" % (pid, _first_error(out)), out)

    def run(self, commands: Sequence[str], timeout: float, calls: bool = False) -> str:
        """Run ``commands`` and return their output.

        On overrun: without ``calls`` gdb is killed (GdbTimeout); with ``calls`` (the batch calls a
        function in the target) gdb is told to detach and quit after it, and is given ``_CALL_GRACE``
        more seconds; if it still has not exited it is left to finish on its own (GdbAbandoned).
        """
        marker = self._send(commands)
        out = self._wait(marker, timeout)
        if out is not None:
            return out
        what = commands[-1] if commands else ""
        if not calls:
            self._kill()
            raise GdbTimeout("gdb did not finish %r within %.1f s" % (what, timeout), step=repr(what))
        self._finish_or_abandon()
        raise GdbTimeout("gdb's call %r into the target did not return within %.1f s" % (what, timeout),
                         step="its call %r into the target" % what)

    def run_call_then_detach(self, commands: Sequence[str], timeout: float) -> str:
        """Run ``commands`` (calls that may wait in the target), then detach and quit.

        On overrun gdb is not killed: it is left to finish, detach and exit by itself.
        """
        marker = self._send(list(commands), finish=True)
        out = self._wait(marker, timeout)
        if out is None:
            self._finish_or_abandon()
            raise GdbTimeout("the call into process %d did not return within %.1f s" % (self.pid, timeout),
                             step="its call into the target")
        self._await_detach(marker)
        return out

    def _finish_or_abandon(self) -> None:
        """gdb is inside a call into the target: let it end the call, detach and quit, never kill it."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            try:
                self._proc.stdin.write(b"detach\nquit\n")
                self._proc.stdin.close()
            except OSError:
                pass
        try:
            self._proc.wait(_CALL_GRACE)
        except subprocess.TimeoutExpired:
            _ABANDONED.append(self._proc)
            raise GdbAbandoned("a call into process %d did not return; gdb (pid %d) was left to finish it and "
                               "detach by itself" % (self.pid, self._proc.pid)) from None

    def detach(self, timeout: float = 2.0) -> None:
        """Detach and quit; kill gdb (and continue the target) if that does not happen in time."""
        if self._proc.poll() is not None or self._proc in _ABANDONED or self._proc in _DETACHED:
            return
        try:
            if self._proc.stdin is not None and not self._proc.stdin.closed:
                marker = self._send([], finish=True)
                self._await_detach(marker, timeout)
                return
        except OSError:
            pass
        self._reap(timeout)

    def _await_detach(self, marker: str, timeout: float = 2.0) -> None:
        """Wait until gdb says it detached (the target runs untraced), then leave it exiting: the caller
        reaps it with finish_detached. gdb killed (and the target continued) where it does not say so."""
        try:
            said = self._wait(marker + "-detached", timeout)
        except GdbError:  # gdb exited without a word: the kernel detached it
            said = None
        if said is None:
            self._reap(0)
        else:
            _DETACHED.append(self._proc)

    def _send(self, commands: Sequence[str], finish: bool = False) -> str:
        self._counter += 1
        marker = "@@probe-%d-%d@@" % (os.getpid(), self._counter)
        lines = list(commands) + ['echo \\n%s\\n' % marker]
        if finish:
            lines += ["detach", 'echo \\n%s-detached\\n' % marker, "quit"]
        assert self._proc.stdin is not None
        self._proc.stdin.write(("\n".join(lines) + "\n").encode())
        self._proc.stdin.flush()
        if finish:
            self._proc.stdin.close()
        return marker

    def _wait(self, marker: str, timeout: float) -> Optional[str]:
        """What gdb wrote before ``marker`` (read up to the marker's end: what follows is the next wait's);
        None when it did not come within ``timeout``."""
        deadline = time.monotonic() + timeout
        start = self._read_pos
        seen = b""
        wanted = marker.encode()
        pause = 0.001  # the target may be stopped while we wait: poll often (a ms of CPU per 0.1 s)
        while True:
            self._log.seek(start + len(seen))
            data = self._log.read()
            if data:
                seen += data
                at = seen.find(wanted)
                if at >= 0:
                    self._read_pos = start + at + len(wanted)
                    return seen[:at].decode("utf-8", "replace")
            if self._proc.poll() is not None and not data:
                self._read_pos = start + len(seen)
                raise GdbError("gdb exited (status %s)" % self._proc.returncode, seen.decode("utf-8", "replace"))
            if time.monotonic() >= deadline:
                return None
            time.sleep(pause)

    def _reap(self, timeout: float) -> None:
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._kill()

    def _kill(self) -> None:
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._proc.wait()
        try:
            os.kill(self.pid, signal.SIGCONT)  # ptrace detached on gdb's death; make sure nothing stays stopped
        except ProcessLookupError:
            pass


def _first_error(out: str) -> str:
    for line in out.splitlines():
        if re.search(r"ptrace|attach|permitted|denied", line, re.I):
            return line.strip()
    return out.strip().splitlines()[-1] if out.strip() else "no output"
