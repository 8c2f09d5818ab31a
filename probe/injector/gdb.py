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
from typing import List, Optional, Sequence

__all__ = ["GdbSession", "GdbError", "GdbTimeout", "GdbAbandoned", "abandoned_gdbs"]

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


class GdbError(Exception):
    """gdb failed; ``output`` is what it printed."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output


class GdbTimeout(GdbError):
    """gdb did not finish a step in time; it was killed and the target continued."""


class GdbAbandoned(GdbError):
    """A call into the target overran; gdb was left to finish it and detach by itself."""


def abandoned_gdbs() -> List["subprocess.Popen[bytes]"]:
    """gdbs left finishing a call (reaped here once they have exited)."""
    _ABANDONED[:] = [p for p in _ABANDONED if p.poll() is None]
    return list(_ABANDONED)


class GdbSession:
    """gdb attached to ``pid`` with only the shared libraries named in ``libraries`` loaded."""

    def __init__(self, pid: int, libraries: Sequence[str], timeout: float, gdb: str = "gdb") -> None:
        self.pid = pid
        self._counter = 0
        self._log = tempfile.TemporaryFile()
        self._read_pos = 0
        self._proc = subprocess.Popen(
            [gdb, "-nx", "-q", "-iex", "set debuginfod enabled off", "-iex", "set auto-load off"],
            stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        commands = list(_SETUP) + ["attach %d" % pid] + ["sharedlibrary %s" % lib for lib in libraries]
        out = self.run(commands, timeout)
        if "ptrace:" in out or "Can't attach" in out or "Could not attach" in out:
            self._kill()
            raise GdbError("gdb could not attach to process %d: %s" % (pid, _first_error(out)), out)

    def run(self, commands: Sequence[str], timeout: float) -> str:
        """Run ``commands`` and return their output; kill gdb and raise GdbTimeout after ``timeout``."""
        marker = self._send(commands)
        out = self._wait(marker, timeout)
        if out is None:
            self._kill()
            raise GdbTimeout("gdb did not finish %r within %.1f s" % (commands[-1] if commands else "", timeout))
        return out

    def run_call_then_detach(self, commands: Sequence[str], timeout: float) -> str:
        """Run ``commands`` (calls that may wait in the target), then detach and quit.

        On overrun gdb is not killed: it is left to finish, detach and exit by itself.
        """
        marker = self._send(list(commands), finish=True)
        out = self._wait(marker, timeout)
        if out is None:
            _ABANDONED.append(self._proc)
            raise GdbAbandoned("the call into process %d did not return within %.1f s" % (self.pid, timeout))
        self._reap(timeout=2.0)
        return out

    def detach(self, timeout: float = 2.0) -> None:
        """Detach and quit; kill gdb (and continue the target) if that does not happen in time."""
        if self._proc.poll() is not None:
            return
        try:
            self._send([], finish=True)
        except OSError:
            pass
        self._reap(timeout)

    def _send(self, commands: Sequence[str], finish: bool = False) -> str:
        self._counter += 1
        marker = "@@probe-%d-%d@@" % (os.getpid(), self._counter)
        lines = list(commands) + ['echo \\n%s\\n' % marker]
        if finish:
            lines += ["detach", "quit"]
        assert self._proc.stdin is not None
        self._proc.stdin.write(("\n".join(lines) + "\n").encode())
        self._proc.stdin.flush()
        if finish:
            self._proc.stdin.close()
        return marker

    def _wait(self, marker: str, timeout: float) -> Optional[str]:
        deadline = time.monotonic() + timeout
        chunks: List[bytes] = []
        pause = 0.001
        while True:
            self._log.seek(self._read_pos)
            data = self._log.read()
            if data:
                self._read_pos += len(data)
                chunks.append(data)
                text = b"".join(chunks).decode("utf-8", "replace")
                if marker in text:
                    return text.split(marker)[0]
            if self._proc.poll() is not None and not data:
                raise GdbError("gdb exited (status %s)" % self._proc.returncode, b"".join(chunks).decode())
            if time.monotonic() >= deadline:
                return None
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

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
