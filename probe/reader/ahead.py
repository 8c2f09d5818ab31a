"""A read from outside started ahead of need: ``probe PID backtrace`` of a process with no agent.

Such a command reads the process with py-spy (``probe.reader.pyspy_source``) once the client has said why no
agent answers (``probe.client.explain``), which takes it most of its start-up in imports and looks at
``/proc``. py-spy's own run (some 10 ms) need not wait for that: ``probe.cli.quick``, seeing no socket for a
Python process of this user that runs, starts the very command the reader would start, and the reader takes
its output (:func:`take`) instead of starting another. Where nothing takes it (the client found something
else to say), it is killed and reaped at exit.

Stdlib only, and nothing that costs a start-up: no ``subprocess`` (``os.posix_spawn`` and two pipes), no
``shutil`` (:func:`which`), no typing at run time.
"""

from __future__ import annotations

import os
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["which", "dump_argv", "start", "take", "Pending"]


def which(name: str) -> Optional[str]:
    """The executable ``name`` beside this interpreter (a venv's bin), else on PATH, as ``shutil.which`` finds it."""
    beside = os.path.join(os.path.dirname(sys.executable), name)
    if os.access(beside, os.X_OK) and not os.path.isdir(beside):
        return beside
    for directory in (os.environ.get("PATH") or os.defpath).split(os.pathsep):
        path = os.path.join(directory or ".", name)
        if os.access(path, os.X_OK) and not os.path.isdir(path):
            return path
    return None


def dump_argv(exe: str, pid: int, native: bool = False, stop: bool = True) -> List[str]:
    """py-spy's command line for a read of ``pid`` (``probe.reader.pyspy_source``; ``stop`` False: ``--nonblocking``)."""
    return [exe, "dump", "--pid", str(pid), "--json"] + (["--native"] if native else []) + ([] if stop else ["--nonblocking"])


class Pending:
    """A command started with its output and errors on pipes of ours."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.argv = list(argv)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            self.pid = os.posix_spawn(self.argv[0], self.argv, os.environ,
                                      file_actions=[(os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2)])
        except BaseException:
            for fd in (out_r, out_w, err_r, err_w):
                os.close(fd)
            raise
        os.close(out_w)
        os.close(err_w)
        self._fds = {out_r: bytearray(), err_r: bytearray()}
        self._out, self._err = out_r, err_r
        self._kept: Dict[int, bytes] = {}
        self._code: Optional[int] = None

    def result(self, timeout: float) -> Tuple[int, str, str]:
        """(exit status, output, errors) once the command ended, within ``timeout`` seconds; TimeoutError
        (the command killed and reaped) past it."""
        import select

        deadline = time.monotonic() + timeout
        try:
            while self._fds:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("%s ran longer than %.0f s" % (self.argv[0], timeout))
                ready, _, _ = select.select(list(self._fds), [], [], left)
                for fd in ready:
                    chunk = os.read(fd, 1 << 16)
                    if chunk:
                        self._fds[fd] += chunk
                    else:
                        self._done(fd)
            _, status = os.waitpid(self.pid, 0)
            self._code = os.waitstatus_to_exitcode(status) if hasattr(os, "waitstatus_to_exitcode") else status >> 8
        except BaseException:
            self.kill()
            raise
        return self._code, self._text(self._out), self._text(self._err)

    def kill(self) -> None:
        """End the command (if it still runs), reap it, and close the pipes."""
        for fd in list(self._fds):
            self._done(fd)
        if self._code is None:
            try:
                os.kill(self.pid, 9)
            except OSError:
                pass
            try:
                os.waitpid(self.pid, 0)
            except OSError:
                pass
            self._code = -9

    def _done(self, fd: int) -> None:
        self._kept[fd] = bytes(self._fds.pop(fd))
        os.close(fd)

    def _text(self, fd: int) -> str:
        return self._kept.get(fd, b"").decode("utf-8", "replace")


_pending: List[Pending] = []


def start(argv: Sequence[str]) -> None:
    """Start ``argv`` now for a reader to :func:`take` later; killed and reaped at exit where none does."""
    if not _pending:
        import atexit

        atexit.register(_end_all)
    _pending.append(Pending(argv))


def take(argv: Sequence[str]) -> Optional[Pending]:
    """The command ``argv`` started ahead, if one was (and no longer kept here); None where none was."""
    for i, pending in enumerate(_pending):
        if pending.argv == list(argv):
            return _pending.pop(i)
    return None


def _end_all() -> None:
    while _pending:
        _pending.pop().kill()
